"""One rank's training: build model and data, `deepspeed.initialize`, train, measure.

`train()` needs only torch.distributed to be set up (by Ray Train, or by torchrun in bench/), so the
bare-DeepSpeed baseline runs the very same code; Ray Train's entry point is in `ray_zero.train_run`.
This is the only module that calls `deepspeed.initialize`; deepspeed is imported inside functions
so that importing the package stays cheap.
"""
from __future__ import annotations

import hashlib
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ray_zero.config import Experiment
from ray_zero.data import mnist_shard, synthetic_shard
from ray_zero.ds_config import build_ds_config
from ray_zero.metrics import MemoryProbe, StepTimer, model_state_bytes, peak_tflops, synchronize
from ray_zero.model import build_model
from ray_zero.sizes import PRESETS
from ray_zero import speed_probe

ProgressFn = Callable[[int, dict[str, float]], None]
# Live figures go to the caller at most this often: Ray exports gauges every 10 s (metrics_report_interval_ms),
# and each publish costs a host-bound step time (Ray's gauges: 0.03-0.07 ms a step at every 5th step on the H200).
PUBLISH_INTERVAL_S = 1.0


class TrialOutOfMemory(RuntimeError):
    """A rank ran out of device memory; carries what the memory looked like at that moment."""

    def __init__(self, message: str, memory: dict[str, Any]):
        super().__init__(message, memory)
        self.memory = memory

    def __str__(self) -> str:
        return self.args[0]


def _attempt_number(attempt_dir: Optional[str], rank: int) -> int:
    """1 on a trial's first try, 2 on its first retry...: counted with marker files per rank."""
    if not attempt_dir:
        return 1
    folder = Path(attempt_dir)
    folder.mkdir(parents=True, exist_ok=True)
    attempt = len(list(folder.glob(f"rank{rank}-attempt-*"))) + 1
    (folder / f"rank{rank}-attempt-{attempt}").touch()
    return attempt


def _inject_fault(experiment: Experiment, stage: int, rank: int, step: int, attempt: int) -> None:
    fault = experiment.fault
    if fault is None or fault.rank != rank or fault.step != step or attempt > fault.attempts:
        return
    if fault.stage is not None and fault.stage != stage:
        return
    where = f"rank {rank}, step {step}, attempt {attempt}"
    if fault.kind == "oom":
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by ray_zero's fault option at {where})")
    if fault.kind == "error":
        raise RuntimeError(f"injected error (ray_zero's fault option at {where})")
    os.kill(os.getpid(), signal.SIGKILL)


def experiment_ds_config(experiment: Experiment, stage: int, micro_batch_size: int, world_size: int,
                         precision: str) -> dict:
    """DeepSpeed's config for one grid point of `experiment`, as a rank builds it."""
    return build_ds_config(
        stage=stage, micro_batch_size=micro_batch_size,
        gradient_accumulation_steps=experiment.gradient_accumulation_steps, world_size=world_size,
        precision=precision, optimizer_type=experiment.optimizer.type, lr=experiment.optimizer.lr,
        betas=tuple(experiment.optimizer.betas), eps=experiment.optimizer.eps,
        weight_decay=experiment.optimizer.weight_decay, reduce_bucket_size=experiment.reduce_bucket_size,
        allgather_bucket_size=experiment.allgather_bucket_size)


def jit_ops_dir() -> str:
    """This Python environment's own folder for DeepSpeed's JIT-built ops (used unless the user sets one).

    torch keys its default build folder by op name, Python version and CUDA only (~/.cache/torch_extensions/
    py311_cu130/deepspeed_shm_comm with a CUDA build of torch), while the build files name the venv's
    include paths: two venvs on one machine rebuild the op in turn, 19-43 s on 2 CPU cores each time (seen
    as a slow first `deepspeed.initialize` after a CI run in another venv).
    """
    from torch.utils.cpp_extension import get_default_build_root

    environment = hashlib.sha1(f"{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:12]
    return os.path.join(get_default_build_root(),
                        f"py{sys.version_info.major}{sys.version_info.minor}-env-{environment}")


def _median_and_p90(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[4], deciles[8]


def _engine_dtype(engine) -> torch.dtype:
    if engine.fp16_enabled():
        return torch.float16
    if engine.bfloat16_enabled():
        return torch.bfloat16
    return torch.float32


def train(
    trial: dict[str, Any],
    rank: int,
    world_size: int,
    device: torch.device,
    on_progress: Optional[ProgressFn] = None,
) -> dict[str, Any]:
    """Train one rank of one trial and return this rank's measurements (a flat dict).

    `trial` holds `experiment` (Experiment as a dict), `point` (stage, micro_batch_size,
    num_workers), `precision` (resolved) and optionally `attempt_dir`.
    """
    experiment = Experiment.model_validate(trial["experiment"])
    point = trial["point"]
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", jit_ops_dir())
    if device.type == "cpu":
        # `import deepspeed` sets PYTORCH_NVML_BASED_CUDA_CHECK=1; without a GPU, torch's optimizers then try
        # to load NVML at every step (torch.cuda.is_available() in Optimizer.step): 1-3 % of a host-bound
        # step, more in a Ray worker (bench/results/host-bound-cpu-2core). The CUDA runtime says none too.
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "0"
    probe = MemoryProbe(device)
    progress = {"phase": "start"}  # where the rank is, for the out-of-memory message
    try:
        return _train(experiment, point, trial, rank, world_size, device, probe, on_progress,
                      set_phase=lambda where: progress.__setitem__("phase", where))
    except torch.cuda.OutOfMemoryError as error:
        phase = progress["phase"]
        peak, current = probe.peak(), probe.current()
        memory = {"rank": rank, "phase": phase, "peak_allocated_gib": peak["allocated_gib"],
                  "peak_reserved_gib": peak["reserved_gib"], "allocated_gib": current["allocated_gib"],
                  "reserved_gib": current["reserved_gib"]}
        first_line = str(error).strip().splitlines()[0][:300]
        raise TrialOutOfMemory(
            f"rank {rank} out of memory during {phase}: peak allocated {peak['allocated_gib']:.2f} GiB, "
            f"reserved {peak['reserved_gib']:.2f} GiB ({first_line})", memory) from None


def _train(experiment: Experiment, point: dict, trial: dict, rank: int, world_size: int,
           device: torch.device, probe: MemoryProbe, on_progress: Optional[ProgressFn],
           set_phase: Callable[[str], None]) -> dict[str, Any]:
    import deepspeed

    stage, micro, accum = point["stage"], point["micro_batch_size"], experiment.gradient_accumulation_steps
    attempt = _attempt_number(trial.get("attempt_dir"), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    probe.reset_peak()
    timeline: dict[str, float] = {}
    torch.manual_seed(experiment.seed)  # same initial weights on every rank

    marks = {"train_started_at": time.time()}  # wall-clock marks, for the start-up breakdown
    set_phase("model build")
    model = build_model(experiment.model).to(device)
    timeline["after_model"] = probe.current()["allocated_gib"]
    marks["model_built_at"] = time.time()

    set_phase("data load")
    if experiment.dataset == "mnist":
        shard = mnist_shard(experiment.data_dir, rank, world_size, device)
    else:
        shard = synthetic_shard(micro * accum, world_size, experiment.seed + rank, device)
    steps_per_epoch = shard.batches_per_epoch(micro) // accum
    if steps_per_epoch < 1:
        raise ValueError(f"micro_batch_size {micro} x gradient_accumulation_steps {accum} is more than "
                         f"this rank's {len(shard.labels)} samples ({shard.source})")
    total_steps = experiment.steps or experiment.epochs * steps_per_epoch
    if experiment.warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps ({experiment.warmup_steps}) must be less than the "
                         f"{total_steps} steps this trial trains")
    batches = shard.micro_batches(micro, seed=experiment.seed + rank)
    timeline["after_data"] = probe.current()["allocated_gib"]
    marks["data_loaded_at"] = time.time()

    set_phase("deepspeed.initialize")
    ds_config = experiment_ds_config(experiment, stage, micro, world_size, trial["precision"])
    # One optimizer, from the config: no client optimizer (the seed script passed both).
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config)
    marks["initialized_at"] = time.time()
    dtype = _engine_dtype(engine)
    timeline["after_initialize"] = probe.current()["allocated_gib"]

    states: dict[str, int] = {}
    gradient_bytes_after_backward = 0
    losses_by_epoch: list[float] = []
    epoch_loss_sum = torch.zeros((), device=device)
    loss_first = loss_last = float("nan")
    timer = StepTimer(device)
    whole_peak = {"allocated_gib": 0.0, "reserved_gib": 0.0}
    window_started, window_step = time.perf_counter(), 0
    window_rates: list[float] = []  # samples/s of each timed window of live_metrics_every steps
    published_at = float("-inf")
    engine.train()
    for step in range(total_steps):
        set_phase(f"step {step}")
        if step == experiment.warmup_steps:
            # Peaks so far include initialize and warm-up; the timed peak starts from here.
            synchronize(device)
            whole_peak = probe.peak()
            probe.reset_peak()
            timer.start()
            marks["warmed_up_at"] = time.time()
            window_started, window_step = time.perf_counter(), step
        _inject_fault(experiment, stage, rank, step, attempt)
        step_loss = torch.zeros((), device=device)
        for micro_step in range(accum):
            timer.lap("other")  # the loop's own bookkeeping, live metrics
            images, labels = next(batches)
            logits = engine(images.to(dtype))  # inputs in the engine's dtype (the seed fed fp32 to fp16)
            loss = F.cross_entropy(logits.float(), labels)
            timer.lap("forward")
            first = step == 0 and micro_step == 0
            if first:
                marks["first_forward_at"] = time.time()  # host only: kernels loaded, cuBLAS handles made
            engine.backward(loss)
            timer.lap("backward")
            if first:
                synchronize(device)
                marks["first_backward_at"] = time.time()  # the device has caught up with the forward too
                timeline["after_first_backward"] = probe.current()["allocated_gib"]
                gradient_bytes_after_backward = model_state_bytes(engine.module, optimizer)["gradient_bytes"]
            engine.step()
            timer.lap("optimizer_step")
            step_loss += loss.detach() / accum
        epoch_loss_sum += step_loss
        if step == 0:
            synchronize(device)
            marks["first_step_at"] = time.time()  # the first step creates communicators, kernels' handles
            timeline["after_first_step"] = probe.current()["allocated_gib"]
            states = model_state_bytes(engine.module, optimizer)
            # Some optimizers free gradients in their step, others keep them: the larger count holds.
            states["gradient_bytes"] = max(states["gradient_bytes"], gradient_bytes_after_backward)
            loss_first = step_loss.item()
        if (step + 1) % steps_per_epoch == 0 and experiment.epochs is not None:
            losses_by_epoch.append(epoch_loss_sum.item() / steps_per_epoch)
            epoch_loss_sum.zero_()
        if step == total_steps - 1:
            loss_last = step_loss.item()
        elif (step + 1) % experiment.live_metrics_every == 0:
            # .item() waits for the device: that makes the window's rate honest.
            loss_value = step_loss.item()
            now = time.perf_counter()
            if step >= experiment.warmup_steps:
                rate = (step + 1 - window_step) * micro * accum / max(now - window_started, 1e-9)
                window_rates.append(rate)
                if on_progress is not None and now - published_at >= PUBLISH_INTERVAL_S:
                    published_at = now
                    on_progress(step + 1, {"loss": loss_value, "samples_per_s": rate,
                                           "peak_allocated_gib": max(whole_peak["allocated_gib"],
                                                                     probe.peak()["allocated_gib"])})
            window_started, window_step = now, step + 1
    timed_s = timer.stop()
    timed_peak = probe.peak()
    marks["finished_at"] = time.time()
    speed = speed_probe.measure() if speed_probe.wanted() else {}  # a diagnosis, off by default
    set_phase("finish")

    timed_steps = total_steps - experiment.warmup_steps
    samples_per_s = timed_steps * micro * accum / timed_s if timed_s > 0 else float("nan")
    window_median, window_p90 = _median_and_p90(window_rates)
    preset = PRESETS[experiment.model]
    achieved_tflops = samples_per_s * preset.flops_per_sample() / 1e12
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(device_name, trial["precision"]) if device.type == "cuda" else None
    result = {
        "rank": rank,
        "attempt": attempt,
        "device_name": device_name,
        "memory_kind": probe.kind,
        "steps": total_steps,
        "timed_steps": timed_steps,
        "timed_s": timed_s,
        "timed_thread_cpu_s": timer.thread_cpu_s,  # the training thread's CPU time in the timed steps
        "timed_thread_system_s": timer.thread_system_s,  # its part in the kernel (10 ms ticks)
        "timed_minor_faults": timer.minor_faults,  # the training thread's minor page faults
        "timed_other_threads_cpu_s": timer.other_threads_cpu_s,  # this process's other threads' CPU time
        "timed_busiest_other_thread_cpu_s": timer.busiest_other_thread_cpu_s,  # on GPUs: autograd's, mostly
        "timed_busiest_other_thread": timer.busiest_other_thread_name,
        # User-space cycles and instructions of the training thread, where the machine counts them.
        "timed_thread_cycles": timer.thread_cycles,
        "timed_thread_instructions": timer.thread_instructions,
        # Host time of each part of the timed steps; their sum less timed_s: the last wait for the device.
        **{f"timed_{phase}_s": timer.phase_s.get(phase) for phase in ("forward", "backward", "optimizer_step", "other")},
        "timed_gc_s": timer.gc_s,  # Python's garbage collector in the timed steps
        "timed_run_queue_s": timer.run_queue_s,  # the training thread runnable, waiting for a core
        "timed_voluntary_switches": timer.voluntary_switches,  # times it blocked (GIL, device, I/O)
        "timed_thread_migrations": timer.migrations,  # times the scheduler moved it to another CPU
        "model_build_s": marks["model_built_at"] - marks["train_started_at"],
        "data_load_s": marks["data_loaded_at"] - marks["model_built_at"],
        "initialize_s": marks["initialized_at"] - marks["data_loaded_at"],
        "warmup_s": marks["warmed_up_at"] - marks["initialized_at"],
        "data_bytes": shard.images.nbytes + shard.labels.nbytes,
        "samples_per_s": samples_per_s,
        # The timed windows' median and 90th percentile: a rate that hiccups of a shared host move less.
        "window_samples_per_s_median": window_median,
        "window_samples_per_s_p90": window_p90,
        "tflops": achieved_tflops,
        "mfu": achieved_tflops / peak if peak else None,
        "loss_first": loss_first,
        "loss_last": loss_last,
        "loss_by_epoch": losses_by_epoch,
        "peak_allocated_gib": max(whole_peak["allocated_gib"], timed_peak["allocated_gib"]),
        "peak_reserved_gib": max(whole_peak["reserved_gib"], timed_peak["reserved_gib"]),
        "timed_peak_allocated_gib": timed_peak["allocated_gib"],
        "timed_peak_reserved_gib": timed_peak["reserved_gib"],
        "nvml_used_gib": probe.nvml_used_gib(),
        "data_source": shard.source,
        "torch_threads": torch.get_num_threads(),  # intra-op threads (Ray sets OMP_NUM_THREADS to a rank's CPUs)
        "niceness": os.nice(0),  # the scheduler priority this rank trained at (Ray's workers: 15 by default)
        # The same folder for every trial: cuDNN's run-time compiled kernels are reused only from there.
        "working_dir": os.getcwd(),
        "jit_ops_dir": os.environ["TORCH_EXTENSIONS_DIR"],  # where DeepSpeed's JIT ops were built or found
        "nvml_cuda_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1",  # torch asks NVML for GPUs
    }
    result.update({f"memory_{k}_gib": v for k, v in timeline.items()})
    result.update(marks)
    result.update(states)
    result.update(speed)
    return result
