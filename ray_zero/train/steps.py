"""A rank's steps once its engine is set up and its turn taken: warm-up, the timed steps, the live
gauges, and the rank's report (a RankReport, ray_zero/schema/). Only the steps are inside the timed
window: the model-state walk comes after it, the gauges' publishing is left out of it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from ray_zero.config import TrialSpec
from ray_zero.measure.meter import SavedForBackward, peak_tflops, synchronize
from ray_zero.models.counting import flops_not_counted
from ray_zero.models.spec import cast_floating
from ray_zero.schema import rank_report
from ray_zero.train.comm import CommCounter, counting
from ray_zero.train.step_clock import StepClock, median_and_spread

PUBLISH_INTERVAL_S = 1.0
"""Live figures go to the caller at most this often: Ray exports gauges every 10 s, and each update costs
a host-bound step time."""


@dataclass
class Data:
    """The rank's data, as its set-up made it."""

    batches: Iterator[Any]
    total_steps: int
    steps_per_epoch: Optional[int]
    bytes: int
    source: str


@dataclass
class Losses:
    first: float = float("nan")
    last: float = float("nan")
    by_epoch: list[float] = field(default_factory=list)


def inject_fault(spec: TrialSpec, rank: int, step: int, attempt: int) -> None:
    """The experiment's deliberate failure (config.Fault) where it matches this rank and step."""
    fault = next((f for f in spec.experiment.fault if f.fires(spec.point, rank, step, attempt)), None)
    if fault is None:
        return
    where = f"rank {rank}, step {step}, attempt {attempt}"
    if fault.kind == "oom":
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory (injected by ray_zero's fault option at {where})"
        )
    if fault.kind == "error":
        raise RuntimeError(f"injected error (ray_zero's fault option at {where})")
    os.kill(os.getpid(), signal.SIGSTOP if fault.kind == "sigstop" else signal.SIGKILL)


MAX_WARMUP_ADDED = 16
"""fp16 warm-up steps added at most while the loss scale skips the optimizer's step (from 2**16 it halves
at each overflow): the timed steps then hold Adam's states, as training does."""


def _optimizer_idle(engine, device: torch.device) -> bool:
    """Whether no rank's optimizer has stepped yet (made its states): fp16's loss scale skipped every step
    so far. All ranks decide alike (the overflow that skips a step is all ranks')."""
    made = torch.tensor([float(engine.model_state_bytes()["optimizer_state_bytes"] > 0)], device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(made, op=torch.distributed.ReduceOp.MAX)
    return not made.item()


COUNTED_STEPS = 3
"""Untimed steps after the timed window, with ray_zero/train/comm.py's wrappers on: the bytes of each
kind of collective per step, and the share of each phase that collectives hold the rank up."""


class _Timing:
    """When the timed window may end: the experiment's timed steps done, then (steps added, within the
    budget) until the window lasts timing_min_s and the steps' spread is within timing_spread."""

    def __init__(self, experiment, total_steps: int):
        self.min_s, self.bound = experiment.timing_min_s, experiment.timing_spread
        planned = total_steps - experiment.warmup_steps
        self.budget = max(experiment.timing_max_steps or planned, planned)
        self.median: Optional[float] = None
        self.spread: Optional[float] = None
        self.met = False

    def settled(self, clock: StepClock, meter) -> bool:
        """Whether the window may end now (the rule met, or the budget spent)."""
        synchronize(meter.device)  # the steps' work is the window's; reading their marks is not
        with meter.untimed():
            seconds = clock.step_seconds()
            self.median, self.spread = median_and_spread(seconds)
            within = self.bound is None or (self.spread is not None and self.spread <= self.bound)
            self.met = sum(seconds) >= self.min_s and within
            return self.met or len(seconds) >= self.budget


def train_steps(run, engine, data: Data) -> dict[str, Any]:
    """Train `engine` for the data's steps as rank `run` (ray_zero/train/worker.py's _Run: its spec, meter,
    phase, timings), more timed steps if the timing asks for them, then the counted steps; this rank's
    report."""
    spec, meter, device = run.spec, run.meter, run.device
    experiment, point = spec.experiment, spec.point
    micro, accum, warmup = (
        point.micro_batch_size,
        experiment.gradient_accumulation_steps,
        experiment.warmup_steps,
    )
    saved = SavedForBackward()
    measured_step = max(warmup - 1, 0)  # one micro-batch measured alone, before the timed steps
    losses, epoch_losses = Losses(), []
    samples_per_step = micro * accum
    published_at = float("-inf")
    states: dict[str, int] = {}
    every = experiment.runtime.live_metrics_every
    timing, clock = _Timing(experiment, data.total_steps), StepClock(device)

    def one_step(step: int) -> torch.Tensor:
        """One optimizer step (its micro-batches, then the optimizer); its loss, left on the device."""
        run.phase = f"step {step}"
        if engine.clock is not None:
            engine.clock.start()
        if spec.experiment.fault:
            inject_fault(spec, run.rank, step, run.attempt)
        step_loss = None
        for micro_step in range(accum):
            batch = cast_floating(next(data.batches), engine.input_dtype)
            boundary = micro_step == accum - 1
            if step == measured_step and micro_step == 0:
                with meter.one_micro_batch():
                    loss = engine.forward_backward(batch, boundary, forward_context=saved)
            else:
                loss = engine.forward_backward(batch, boundary)
            if step == 0 and micro_step == 0:
                meter.after("first_backward")
            # No arithmetic for one micro-batch: the loss is read (and summed) only where it is shown.
            part = loss if accum == 1 else loss.float() / accum
            step_loss = part if step_loss is None else step_loss + part
        engine.step()
        return step_loss

    # Wall-clock bounds of what this rank measures (warm-up to the last timed step): trials that share a
    # device must never overlap there (their turns, ray_zero/train/turn.py).
    run.timings["measuring_from"] = time.time()
    step, added = 0, 0
    while True:
        idle = step == warmup and spec.precision == "fp16" and added < MAX_WARMUP_ADDED
        if idle and _optimizer_idle(engine, device):  # warm-up ends once the optimizer has stepped
            warmup, added, data.total_steps = warmup + 1, added + 1, data.total_steps + 1
        if step == warmup:
            run.done("warmup")
            meter.start_timing(step)
            engine.clock = clock  # the phases' ends only: no collective is wrapped in the timed window
            if run.diagnostics:
                run.diagnostics.start_timed()
        step_loss = one_step(step)
        if step == 0:  # a warm-up step (warmup_steps >= 1): outside the timed window
            meter.after("first_step")
            losses.first = step_loss.item()
            states = engine.model_state_bytes()
        if step < data.total_steps and data.steps_per_epoch and experiment.epochs is not None:
            epoch_losses.append(step_loss)
            if (step + 1) % data.steps_per_epoch == 0:
                epoch = torch.stack(epoch_losses).float().sum().item()
                losses.by_epoch.append(round(epoch / data.steps_per_epoch, 5))
                epoch_losses = []
        step += 1
        window = step % every == 0 and step > warmup
        # The rule is checked where the device is waited for anyway (a window's end), and at the budget.
        check = window or step == data.total_steps or step - warmup >= timing.budget
        ended = step >= data.total_steps and check
        if ended and timing.settled(clock, meter):
            losses.last = step_loss.item()
            break
        if window:
            loss_value = step_loss.item()  # waits for the device: that makes the window's rate honest
            rate = meter.end_window(step, samples_per_step)
            now = time.perf_counter()
            if run.on_progress is not None and now - published_at >= PUBLISH_INTERVAL_S:
                with meter.untimed():  # its time is not the steps'
                    run.on_progress(
                        step,
                        {
                            "loss": loss_value,
                            "samples_per_s": rate,
                            "peak_allocated_gib": meter.peak_so_far_gib(),
                        },
                    )
                published_at = time.perf_counter()  # from its end: the next comes a whole interval later
    meter.stop_timing(step - warmup, samples_per_step)
    run.timings["measuring_until"] = time.time()
    if run.diagnostics:
        run.diagnostics.stop_timed()
    counted = _counted_steps(run, engine, one_step, step)
    # After the first step and the last: a skipped step (fp16's loss scale overflowing at the start)
    # creates no optimizer states, and they appear at a later step. Walked after the timed window.
    states = {k: max(v, states.get(k, 0)) for k, v in engine.model_state_bytes().items()}
    run.phase = "finish"
    figures = {
        **states,
        **clock.split(counted["shares"]),
        **counted["bytes"],
        "steps": step,
        "counted_steps": COUNTED_STEPS,
        "step_median_s": timing.median,
        "step_spread": timing.spread,
        "timing_unstable": not timing.met,
        "warmup_steps_added": added,
    }
    return _report(run, engine, data, figures, losses, saved.bytes)


def _counted_steps(run, engine, one_step, first: int) -> dict[str, Any]:
    """COUNTED_STEPS steps after the timed window, the collectives counted (ray_zero/train/comm.py) and
    DDP's reducer's bytes added: bytes per step by kind, and the share of each phase collectives held."""
    counter = CommCounter(run.device)
    engine.clock = StepClock(run.device, counter)
    try:
        with counting(counter):
            for step in range(first, first + COUNTED_STEPS):
                one_step(step)
                for kind, nbytes in engine.reducer_bytes().items():
                    counter.count(kind, nbytes)
        synchronize(run.device)
        return {"bytes": counter.per_step(COUNTED_STEPS), "shares": engine.clock.held_shares()}
    finally:
        engine.clock = None


def _report(
    run, engine, data: Data, measured: dict[str, Any], losses: Losses, saved_bytes: int
) -> dict[str, Any]:
    figures = run.meter.result()
    cuda = run.device.type == "cuda"
    device_name = torch.cuda.get_device_name(run.device) if cuda else "cpu"
    # Model FLOPs (counted once, without recomputation): MFU does not credit activation checkpointing.
    flops = run.spec.model.flops_per_sample
    tflops = figures["samples_per_s"] * flops / 1e12 if flops else None
    peak = peak_tflops(device_name, run.spec.precision) if cuda else None
    return rank_report(
        {
            "rank": run.rank,
            "attempt": run.attempt,
            "device_name": device_name,
            # Which GPU: trials that share one take turns on it (ray_zero/train/turn.py).
            "device_uuid": str(torch.cuda.get_device_properties(run.device).uuid) if cuda else None,
            "loss_first": losses.first,
            "loss_last": losses.last,
            "loss_by_epoch": losses.by_epoch,
            "tflops": tflops,
            "mfu": tflops / peak if tflops is not None and peak else None,
            "mfu_blank": _mfu_blank(run.spec, device_name, peak),
            "data_bytes": data.bytes,
            "data_source": data.source,
            "saved_for_backward_bytes": saved_bytes,  # one micro-batch's activations, counted by autograd
            "engine_config": engine.config,  # what it was built with (DeepSpeed: its config, key for key)
            "loss_scale_fix": engine.loss_scale_fix,
            **figures,
            **measured,
            **run.timings,
        }
    )


def _mfu_blank(spec, device_name: str, peak: Optional[float]) -> Optional[str]:
    """Why the rank reports no MFU (and, where the FLOPs are unknown, no TFLOP/s), in one line."""
    if not spec.model.flops_per_sample:
        return flops_not_counted(spec.model.description)
    if device_name == "cpu":
        return "a CPU rank: no peak FLOP/s to divide by"
    if peak is None:
        return (
            f"no peak FLOP/s known for {device_name!r} at {spec.precision} "
            "(ray_zero/measure/meter.py's PEAK_TFLOPS, by exact device name)"
        )
    return None
