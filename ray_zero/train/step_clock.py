"""Where a step's time goes: forward, backward and the optimizer step, each less the time collectives held
the rank up in it, and that time (exposed communication); and each timed step's duration, for the
per-step median and spread (ray_zero/train/steps.py's stopping rule).

Two clocks: the timed steps' marks the phases' ends only (no collective is wrapped there); the counted
steps after the timed window (ray_zero/train/comm.py's wrappers on) also take the holds of each phase.
`split(shares)` gives each timed phase less the share of it that collectives held the rank up in the
counted steps, and the sum of those shares' times (exposed communication): the parts add up to the
timed steps' mean step, which comes within a little of the timed window that samples/s is made from
(what a step does after its optimizer step, the loss read back, is outside it). A share, not the counted
steps' seconds: they run beside the wrappers, and a step just after the window's end is not one inside.

On a GPU the marks are CUDA events on the current stream, read once the device has caught up (recording
one costs a few microseconds of the host's time; four or more a step); on CPU the host's clock. A step
runs from its start (before its first micro-batch is fetched) to the end of its optimizer step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch

from ray_zero.train.comm import CommCounter

PHASES = ("forward", "backward", "optimizer")


class StepClock:
    """Marks of steps (the holds of `comm`'s collectives too, if given); read once the device caught up."""

    def __init__(self, device: torch.device, comm: Optional[CommCounter] = None):
        self.device, self.comm = device, comm
        self._steps: list[list[tuple[str, Any, Any]]] = []  # per step: (phase, its end mark, its hold)
        self._read: list[tuple[dict[str, float], dict[str, float], float]] = []
        """Complete steps already read: (each phase's time, each phase's hold, the step's time)."""

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """At the start of a step."""
        if self.comm is not None:
            self.comm.take_held()  # what came before the step is not its
        self._steps.append([("start", self._now(), None)])

    def mark(self, phase: str) -> None:
        """The end of a phase of the current step (engines call it: ray_zero/train/engine_base.py)."""
        if self._steps:
            self._steps[-1].append((phase, self._now(), self.comm.take_held() if self.comm else None))

    def _seconds(self, since: Any, until: Any) -> float:
        if self.device.type == "cuda":
            return since.elapsed_time(until) / 1000
        return until - since

    def _steps_read(self) -> list[tuple[dict[str, float], dict[str, float], float]]:
        """The complete steps (ended by their optimizer step), read; the device must have caught up with
        their marks. A step cut short (an error) is left out."""
        complete = [marks for marks in self._steps if marks[-1][0] == "optimizer"]
        for marks in complete[len(self._read) :]:
            spent, held = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
            for (_, since, _), (phase, until, hold) in zip(marks, marks[1:]):
                spent[phase] += self._seconds(since, until)
                held[phase] += CommCounter.seconds(hold) if self.comm is not None else 0.0
            self._read.append((spent, held, self._seconds(marks[0][1], marks[-1][1])))
        return self._read

    def step_seconds(self) -> list[float]:
        """Each complete step's time, start to the end of its optimizer step."""
        return [seconds for _, _, seconds in self._steps_read()]

    def held_shares(self) -> dict[str, float]:
        """The share of each phase's time (over the complete steps) that collectives held the rank up."""
        read = self._steps_read()
        return {
            phase: min(sum(h[phase] for _, h, _ in read) / spent, 1.0) if spent > 0 else 0.0
            for phase, spent in ((phase, sum(s[phase] for s, _, _ in read)) for phase in PHASES)
        }

    def split(self, shares: Optional[dict[str, float]] = None) -> dict[str, Optional[float]]:
        """Means over the complete steps: forward_s, backward_s, optimizer_s, each less the share of it that
        collectives held the rank up (`shares`: another clock's held_shares, default this one's), the sum
        of those (exposed_comm_s), and step_s."""
        read = self._steps_read()
        if not read:
            return {f"{name}_s": None for name in (*PHASES, "exposed_comm", "step")}
        shares = self.held_shares() if shares is None else shares
        split: dict[str, Optional[float]] = {"exposed_comm_s": 0.0}
        for phase in PHASES:
            spent = statistics.fmean(s[phase] for s, _, _ in read)
            held = spent * min(max(shares.get(phase, 0.0), 0.0), 1.0)
            split[f"{phase}_s"] = spent - held
            split["exposed_comm_s"] += held
        split["step_s"] = statistics.fmean(seconds for _, _, seconds in read)
        return split


def median_and_spread(seconds: list[float]) -> tuple[Optional[float], Optional[float]]:
    """The steps' median time and spread: their interquartile range over the median (torch.utils.benchmark's
    measure of a timing's stability); None for fewer than two steps."""
    if len(seconds) < 2:
        return (seconds[0] if seconds else None), None
    low, median, high = statistics.quantiles(seconds, n=4, method="inclusive")
    return median, (high - low) / median if median > 0 else None
