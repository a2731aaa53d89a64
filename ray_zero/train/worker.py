"""One rank's trial: build the model and its data, set up the engine (beside other trials' set-ups on a
shared GPU), wait for the device's measurement turn, train and measure (ray_zero/train/steps.py), let go.

`train()` needs only torch.distributed to be set up (by Ray Train, or by torchrun in bench/), so the
bare-DeepSpeed baseline runs the very same code; Ray Train's entry point is `ray_zero.run.trial.train_loop`.
What the rank measures is in a `Meter` beside the loop (ray_zero/measure/meter.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ray_zero.config import TrialSpec
from ray_zero.measure.meter import Meter
from ray_zero.models.describe import build_model_spec
from ray_zero.models.spec import SYNTHETIC_BATCHES, ModelSpec, batch_bytes
from ray_zero.train.data import mnist_shard, synthetic_batches
from ray_zero.train.engine_base import Engine
from ray_zero.train.engines import build_engine
from ray_zero.train.settings import EngineSettings
from ray_zero.train.steps import Data, train_steps
from ray_zero.train.turn import TURN_WAIT, MeasurementTurn, gpu_turn

ProgressFn = Callable[[int, dict[str, float]], None]


class TrialOutOfMemory(RuntimeError):
    """A rank ran out of device memory; carries what the memory looked like at that moment."""

    def __init__(self, message: str, memory: dict[str, Any]):
        super().__init__(message, memory)
        self.memory = memory

    def __str__(self) -> str:
        return self.args[0]


def jit_ops_dir() -> str:
    """This Python environment's own folder for DeepSpeed's JIT-built ops (unless the user sets one).

    torch keys its default build folder by op name, Python version and CUDA only, while the build files
    name the venv's include paths: two venvs on one machine rebuild the op in turn, tens of seconds each
    time (bench/startup_profile.md, cut 13)."""
    from torch.utils.cpp_extension import get_default_build_root

    environment = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:12]
    return os.path.join(
        get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}-env-{environment}"
    )


def train(
    spec: TrialSpec,
    rank: int,
    world_size: int,
    device: torch.device,
    attempt: int = 1,
    on_progress: Optional[ProgressFn] = None,
    diagnostics=None,
    model: Optional[ModelSpec] = None,
    turn: Optional[MeasurementTurn] = None,
    on_phase: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    """Train one rank of one trial and return this rank's measurements (a flat dict). `model`: the model
    to train, already built (fit's probes reuse one); by default the rank builds the experiment's, on its
    device. `turn`: the device's measurement turn, taken before the first warm-up step and handed on once
    the engine has let go of its memory (default: the GPU's, ray_zero/train/turn.py; none on CPU).
    `on_phase(name)`: told where the rank is (model build, ..., step N at most once a second), for a
    watchdog that must say where a trial hung."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", jit_ops_dir())
    if device.type == "cpu":
        # `import deepspeed` sets PYTORCH_NVML_BASED_CUDA_CHECK=1; without a GPU torch's optimizers then
        # load NVML at every step (its cost: bench/startup_profile.md, cut 14).
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "0"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    meter = Meter(device)
    run = _Run(spec, rank, world_size, device, attempt, meter, on_progress, diagnostics, model)
    run.turn, run.on_phase = turn or gpu_turn(device), on_phase
    try:
        return run.train()
    except torch.cuda.OutOfMemoryError as error:
        memory = {"rank": rank, "phase": run.phase, **meter.at_failure()}
        first_line = str(error).strip().splitlines()[0][:300]
        raise TrialOutOfMemory(
            f"rank {rank} out of memory during {run.phase}: peak allocated "
            f"{memory['peak_allocated_gib']:.2f} GiB, "
            f"reserved {memory['peak_reserved_gib']:.2f} GiB ({first_line})",
            memory,
        ) from None


class _Run:
    """One rank's trial: set-up, then the training loop; `phase` says where it is (for an OOM message)."""

    def __init__(self, spec, rank, world_size, device, attempt, meter, on_progress, diagnostics, model=None):
        self.spec, self.rank, self.world_size, self.device = spec, rank, world_size, device
        self.model = model
        self.attempt, self.meter, self.on_progress, self.diagnostics = (
            attempt,
            meter,
            on_progress,
            diagnostics,
        )
        self.on_phase: Optional[Callable[[str], None]] = None
        self._phase, self._phase_told_at = "start", float("-inf")
        self.turn: Optional[MeasurementTurn] = None
        self.timings: dict[str, float] = {}
        self._since = time.perf_counter()

    @property
    def phase(self) -> str:
        """Where the rank is: an OOM message says it, and `on_phase` is told (steps at most once a second)."""
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase = name
        now = time.monotonic()
        if self.on_phase is not None and (not name.startswith("step ") or now - self._phase_told_at >= 1.0):
            self._phase_told_at = now
            with self.meter.untimed():  # between timed steps: its time is not theirs
                self.on_phase(name)

    def done(self, phase: str, memory_phase: Optional[str] = None) -> None:
        """Close a set-up phase: its duration, the memory after it, its diagnostics mark."""
        now = time.perf_counter()
        self.timings[f"{phase}_s"] = now - self._since
        self._since = now
        if memory_phase:
            self.meter.after(memory_phase)
        if self.diagnostics:
            self.diagnostics.mark(phase)

    def train(self) -> dict[str, Any]:
        # Set-up beside other trials' set-ups on this device, never while one of them measures or waits
        # for its turn: waiting for it, the rank waits for the GPU (turn_wait_s, not its model build).
        slot = contextlib.nullcontext()
        if self.turn is not None:
            self.phase = TURN_WAIT
            slot = self.turn.setting_up(self.world_size == 1)
        with slot:
            self._since = time.perf_counter()
            self.timings["set_up_from"] = time.time()
            engine, data = self._set_up()
            self.timings["set_up_until"] = time.time()
        try:
            self._take_turn()
            return train_steps(self, engine, data)
        finally:
            engine.close()
            if self.turn is not None:
                # What the trial no longer needs goes back before the next trial's warm-up: only its
                # resident bytes stay until its process ends (ray_zero/run/gpu_sharing.py's rule).
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.turn.release()

    def _set_up(self) -> tuple[Engine, Data]:
        """Model, data and engine: what the rank does before it measures."""
        spec, experiment, point = self.spec, self.spec.experiment, self.spec.point
        micro, accum = point.micro_batch_size, experiment.gradient_accumulation_steps
        torch.manual_seed(experiment.seed)  # the same initial weights on every rank

        self.phase = "model build"
        model, self.model = self.model, None  # the run keeps no reference: a torn-down probe frees it all
        if model is None:
            # Built where it trains: a GPU initialises the weights in a fraction of the host's time, and
            # nothing is copied (the same shapes and initialisation; the device's random stream).
            with torch.device(self.device):
                model = build_model_spec(spec.model_source())
        model.module.to(self.device)
        self.done("model_build", "model")

        self.phase = "data load"
        data_seed = experiment.seed + self.rank
        if experiment.resolved_dataset() == "mnist":
            shard = mnist_shard(experiment.data_dir, self.rank, self.world_size, self.device)
            batches, data_source = shard.micro_batches(micro, seed=data_seed), shard.source
            data_bytes, steps_per_epoch = (
                shard.images.nbytes + shard.labels.nbytes,
                shard.batches_per_epoch(micro) // accum,
            )
            if steps_per_epoch < 1:
                raise ValueError(
                    f"micro_batch_size {micro} x gradient_accumulation_steps {accum} is more than "
                    f"this rank's {len(shard.labels)} samples ({shard.source})"
                )
        else:
            pool = synthetic_batches(model.make_batch, micro, SYNTHETIC_BATCHES, data_seed, self.device)
            batches = (pool[i % len(pool)] for i in range(10**12))
            data_source, data_bytes, steps_per_epoch = (
                f"synthetic ({len(pool)} batches of {micro})",
                sum(map(batch_bytes, pool)),
                None,
            )
        total_steps = experiment.steps or experiment.epochs * steps_per_epoch
        warmup = experiment.warmup_steps
        if warmup >= total_steps:
            raise ValueError(
                f"warmup_steps ({warmup}) must be less than the {total_steps} steps this trial trains"
            )
        self.done("data_load", "data")

        self.phase = "engine set-up"
        engine = build_engine(model, EngineSettings.for_trial(spec, self.world_size), self.device)
        self.done("initialize", "initialize")
        return engine, Data(batches, total_steps, steps_per_epoch, data_bytes, data_source)

    def _take_turn(self) -> None:
        """Wait for the device's measurement turn, holding only what is in use; then all ranks start
        their warm-up together."""
        if self.turn is None:
            return
        self.phase = TURN_WAIT
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        before_set_up = self.turn.waited_s
        self.turn.acquire()
        if self.world_size > 1:
            dist.barrier()
        self.done("turn_wait")
        self.timings["turn_wait_s"] += before_set_up
