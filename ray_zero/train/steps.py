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
from ray_zero.measure.meter import SavedForBackward, peak_tflops
from ray_zero.models.spec import cast_floating
from ray_zero.schema import rank_report
from ray_zero.train.comm import CommCounter
from ray_zero.train.step_clock import StepClock

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


def train_steps(run, engine, data: Data) -> dict[str, Any]:
    """Train `engine` for the data's steps as rank `run` (ray_zero/train/worker.py's _Run: its spec, meter,
    phase, timings); this rank's report."""
    spec, meter, device = run.spec, run.meter, run.device
    experiment, point = spec.experiment, spec.point
    micro, accum, warmup = (
        point.micro_batch_size,
        experiment.gradient_accumulation_steps,
        experiment.warmup_steps,
    )
    saved = SavedForBackward()
    measured_step = max(warmup - 1, 0)  # one micro-batch measured alone, before the timed steps
    losses, epoch_loss = Losses(), torch.zeros((), device=device)
    samples_per_step = micro * accum
    published_at = float("-inf")
    states: dict[str, int] = {}
    # Wall-clock bounds of what this rank measures (warm-up to the last timed step): trials that share a
    # device must never overlap there (their turns, ray_zero/train/turn.py).
    run.timings["measuring_from"] = time.time()
    comm = CommCounter(device)
    clock = StepClock(device, comm)
    for step in range(data.total_steps):
        run.phase = f"step {step}"
        if step == warmup:
            run.done("warmup")
            meter.start_timing(step)
            comm.__enter__()  # the timed steps' collectives, and where their time goes
            engine.clock = clock
            if run.diagnostics:
                run.diagnostics.start_timed()
        if step >= warmup:
            clock.start()
        inject_fault(spec, run.rank, step, run.attempt)
        step_loss = torch.zeros((), device=device)
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
            step_loss += loss.float() / accum
        engine.step()
        epoch_loss += step_loss
        if step == 0:  # a warm-up step (warmup_steps >= 1): outside the timed window
            meter.after("first_step")
            losses.first = step_loss.item()
            states = engine.model_state_bytes()
        if data.steps_per_epoch and experiment.epochs is not None and (step + 1) % data.steps_per_epoch == 0:
            losses.by_epoch.append(round(epoch_loss.item() / data.steps_per_epoch, 5))
            epoch_loss.zero_()
        if step == data.total_steps - 1:
            losses.last = step_loss.item()
        elif (step + 1) % experiment.runtime.live_metrics_every == 0 and step >= warmup:
            loss_value = step_loss.item()  # waits for the device: that makes the window's rate honest
            rate = meter.end_window(step + 1, samples_per_step)
            now = time.perf_counter()
            if run.on_progress is not None and now - published_at >= PUBLISH_INTERVAL_S:
                published_at = now
                with meter.untimed():  # its time is not the steps'
                    run.on_progress(
                        step + 1,
                        {
                            "loss": loss_value,
                            "samples_per_s": rate,
                            "peak_allocated_gib": meter.peak_so_far_gib(),
                        },
                    )
    meter.stop_timing(data.total_steps - warmup, samples_per_step)
    run.timings["measuring_until"] = time.time()
    comm.__exit__(None, None, None)
    engine.clock = None
    split = {**clock.split(), **comm.per_step(data.total_steps - warmup)}
    # After the first step and the last: a skipped step (fp16's loss scale overflowing at the start)
    # creates no optimizer states, and they appear at a later step. Walked after the timed window.
    states = {k: max(v, states.get(k, 0)) for k, v in engine.model_state_bytes().items()}
    if run.diagnostics:
        run.diagnostics.stop_timed()
    run.phase = "finish"
    return _report(run, engine, data, {**states, **split}, losses, saved.bytes)


def _report(
    run, engine, data: Data, states: dict[str, Any], losses: Losses, saved_bytes: int
) -> dict[str, Any]:
    figures = run.meter.result()
    cuda = run.device.type == "cuda"
    device_name = torch.cuda.get_device_name(run.device) if cuda else "cpu"
    # Model FLOPs (counted once, without recomputation): MFU does not credit activation checkpointing.
    tflops = figures["samples_per_s"] * run.spec.model.flops_per_sample / 1e12
    peak = peak_tflops(device_name, run.spec.precision) if cuda else None
    return rank_report(
        {
            "rank": run.rank,
            "attempt": run.attempt,
            "device_name": device_name,
            # Which GPU: trials that share one take turns on it (ray_zero/train/turn.py).
            "device_uuid": str(torch.cuda.get_device_properties(run.device).uuid) if cuda else None,
            "steps": data.total_steps,
            "loss_first": losses.first,
            "loss_last": losses.last,
            "loss_by_epoch": losses.by_epoch,
            "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "data_bytes": data.bytes,
            "data_source": data.source,
            "saved_for_backward_bytes": saved_bytes,  # one micro-batch's activations, counted by autograd
            "engine_config": engine.config,  # what it was built with (DeepSpeed: its config, key for key)
            "loss_scale_fix": engine.loss_scale_fix,
            **figures,
            **states,
            **run.timings,
        }
    )
