"""The experiment's sections, each a strict pydantic model: the grid Ray Tune sweeps, the optimizer,
fine-tuning (LoRA, frozen parameters), fault injection and the runtime (how the sweep runs on Ray; its
storage path must hold no credentials).

Every field has a one-line docstring (shown by `python -m ray_zero keys`, through pydantic's
use_attribute_docstrings).
"""

from __future__ import annotations

import itertools
from typing import Any, Literal, Optional, Union
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ray_zero.config.points import BACKEND_STAGES, Backend, Offload, Point, Stage, unsupported
from ray_zero.models.finetune import FineTuneSpec, LoraSpec

SECRET_QUERY_KEYS = {
    "access_key",
    "secret_key",
    "session_token",
    "password",
    "token",
    "sas_token",
    "account_key",
}


class StrictModel(BaseModel):
    # strict: YAML's "8" (a string) or `true` must not silently become an integer.
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        use_attribute_docstrings=True,
        frozen=True,
        populate_by_name=True,
        serialize_by_alias=True,
    )


class Grid(StrictModel):
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
    seq_len: Optional[list[int]] = Field(default=None, min_length=1)
    """Tokens per sample, an axis for token models (each value its own point, predicted from its own traced
    step); unset: the experiment's seq_len, one value."""

    @field_validator(
        "backend",
        "stage",
        "micro_batch_size",
        "num_workers",
        "activation_checkpointing",
        "offload_optimizer",
        "seq_len",
        mode="before",
    )
    @classmethod
    def _scalar_to_list(cls, value: Any) -> Any:
        return value if isinstance(value, list) or value is None else [value]

    @field_validator("micro_batch_size", "num_workers", "seq_len")
    @classmethod
    def _at_least_one(cls, values: Optional[list[int]]) -> Optional[list[int]]:
        bad = [v for v in values or [] if v < 1]
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
            Point(b, s, m, w, ac, o, n)
            for b, s, m, w, ac, o, n in itertools.product(
                dict.fromkeys(self.backend),
                sorted(set(self.stage)),
                sorted(set(self.micro_batch_size)),
                sorted(set(self.num_workers)),
                sorted(set(self.activation_checkpointing)),
                dict.fromkeys(self.offload_optimizer),
                sorted(set(self.seq_len)) if self.seq_len else [None],
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


class Optimizer(StrictModel):
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


class Lora(StrictModel):
    """LoRA adapters through the PEFT library (pip install 'ray_zero[finetune]'), in peft.LoraConfig's
    names; every other parameter is frozen."""

    r: int = Field(default=8, gt=0)
    """Rank of each adapter (its two matrices: r x in and out x r)."""
    lora_alpha: float = Field(default=8, gt=0)
    """Scaling: the adapter's update is multiplied by lora_alpha / r."""
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input."""
    target_modules: Union[list[str], str, None] = None
    """Modules to adapt: names (a module's full name or its last dotted parts, e.g. [q_proj, v_proj]), a
    regex string, or all-linear; unset: peft's default for the Transformers architecture."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Biases that train beside the adapters: none, all, or those of the adapted layers."""

    @field_validator("target_modules")
    @classmethod
    def _some(cls, value: Union[list[str], str, None]) -> Union[list[str], str, None]:
        if value is not None and not value:
            raise ValueError("give at least one module name, a regex or all-linear (unset: peft's default)")
        return value


class FineTune(StrictModel):
    """Fine-tuning: LoRA adapters, frozen parameters, or both (LoRA first, then the freeze patterns)."""

    lora: Optional[Lora] = None
    """LoRA adapters (peft); unset: no adapters."""
    freeze: list[str] = Field(default_factory=list)
    """fnmatch patterns over the parameter names that named_parameters() gives (after LoRA): what they
    match does not train, e.g. ["transformer.wte.*", "transformer.h.0.*"]."""

    @field_validator("freeze", mode="before")
    @classmethod
    def _one_or_several(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _something(self) -> "FineTune":
        if self.lora is None and not self.freeze:
            raise ValueError("give lora, freeze or both (or leave finetune out: every parameter trains)")
        return self

    def spec(self) -> FineTuneSpec:
        """The section as models/finetune.py takes it."""
        lora = self.lora
        return FineTuneSpec(
            lora=None
            if lora is None
            else LoraSpec(
                r=lora.r,
                lora_alpha=lora.lora_alpha,
                lora_dropout=lora.lora_dropout,
                target_modules=tuple(lora.target_modules)
                if isinstance(lora.target_modules, list)
                else lora.target_modules,
                bias=lora.bias,
            ),
            freeze=tuple(self.freeze),
        )


class Fault(StrictModel):
    """Fault injection, for testing the failure paths on purpose (never set it for measurements)."""

    kind: Literal["oom", "error", "sigkill", "sigstop"]
    """oom raises torch.cuda.OutOfMemoryError, error a RuntimeError, sigkill kills the worker process,
    sigstop stops it (a hung rank: the trial's bound, runtime.trial_timeout_s, ends it)."""
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


class Runtime(StrictModel):
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
    share_gpus: bool = True
    """On GPUs, start several trials on one GPU when their predicted memory fits there together: each
    builds its model and engine beside the others, then waits for the GPU's measurement turn, so that no
    two trials' warm-up or timed steps overlap on one GPU (run/gpu_sharing.py says the rule). false: one
    trial per GPU at a time (+1 starting early, overlap_startup)."""
    max_trials_per_gpu: Union[Literal["auto"], int] = "auto"
    """With share_gpus: at most this many trials on one GPU at once (each is a process, with its CUDA
    context and its share of the host's CPUs and memory). auto: the cluster's CPUs per GPU, and no more
    than its memory holds at 4 GiB of host memory a trial (run/gpu_sharing.py)."""
    trial_timeout_s: Union[Literal["auto"], float, None] = "auto"
    """A trial's bound: past this many seconds of its own (its GPU turns' waits left out) it is stopped,
    its ranks' stacks kept, and its row says timeout. auto: 600 s, or four times its steps at a
    pessimistic speed if longer; null: none. The process group's timeout follows it."""
    max_failures: int = Field(default=0, ge=0)
    """Retries of a trial whose worker dies (while training, or while its worker group starts), before it
    is recorded as failed."""
    storage_path: Optional[str] = None
    """Where Tune and Train keep run state: a local or shared folder, or a URI such as s3://bucket/path
    (defaults to the output folder). Must be reachable from every node on a multi-node cluster."""
    live_metrics_every: int = Field(default=5, gt=0)
    """Update the dashboard gauges (and the timed windows' rates) every this many steps."""
    refresh_s: float = Field(default=30.0, ge=0)
    """During a sweep, redraw the tables, plots and report.html (and the storage path's copy) at most every
    this many seconds, at most a fiftieth of the time and 0.1 s of CPU per row, the figures from at most
    48 rows, in a thread beside the trials; always once at the end, from every row. 0: as often as that
    allows."""
    profile: Optional[str] = None
    """A file of `python -m ray_zero profile` (a device's kernel rates; sweep/fit --profile FILE sets it):
    each row then stores its step time predicted from its traced step on that device, term by term, beside
    the measured samples/s (on CPU too, its step traced for it). Read once before Ray starts."""
    loggers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list)
    """Ray Tune's logger callbacks that get every row, flat: tensorboard (event files in each trial's Tune
    folder), mlflow (a run per trial, in MLFLOW_TRACKING_URI or a file store in the output folder's
    mlruns/), wandb (a run per trial in WANDB_PROJECT or the experiment's name; WANDB_MODE=offline keeps
    it on disk). Each needs its package: pip install 'ray_zero[mlflow]' or 'ray_zero[wandb]'."""

    @field_validator("loggers", mode="before")
    @classmethod
    def _one_or_several(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("trial_timeout_s", mode="before")
    @classmethod
    def _a_bound(cls, value: Any) -> Any:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value not in ("auto", None) and not (number and value > 0):
            raise ValueError(f"must be auto, a positive number of seconds or null (none), not {value!r}")
        return float(value) if number else value

    @field_validator("max_trials_per_gpu", mode="before")
    @classmethod
    def _auto_or_a_count(cls, value: Any) -> Any:
        if value != "auto" and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"must be auto or an integer of at least 1, not {value!r}")
        return value

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
