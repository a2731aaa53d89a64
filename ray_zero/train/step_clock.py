"""Where a timed step's time goes: forward, backward and the optimizer step, less the time collectives
held the rank up in them, and that time (exposed communication), per step; means over the timed steps
in the rank's report (they add up to the timed window, which samples/s is made from, less the little
each step does after its optimizer step).

On a GPU the marks are CUDA events on the current stream (no synchronisation inside the steps: they are
read once the timed window has ended and the device has caught up; recording an event costs a few
microseconds of the host's time each, four or more a step), and the collectives' hold is the time the
stream waited for them (ray_zero/train/comm.py). On CPU the marks are the host's clock. A step runs from
its start (before its first micro-batch is fetched) to the end of its optimizer step; what comes after
(the loss read back, the live gauges) is not in it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import torch

from ray_zero.train.comm import CommCounter

PHASES = ("forward", "backward", "optimizer")


class StepClock:
    """Marks of the timed steps; `split()` once the device has caught up."""

    def __init__(self, device: torch.device, comm: CommCounter):
        self.device, self.comm = device, comm
        self._steps: list[list[tuple[str, Any, Any]]] = []  # per step: (phase, its end mark, its hold)

    def _now(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """At the start of a timed step."""
        self.comm.take_held()  # what came before the step is not its
        self._steps.append([("start", self._now(), None)])

    def mark(self, phase: str) -> None:
        """The end of a phase of the current step (engines call it: ray_zero/train/engine_base.py)."""
        if self._steps:
            self._steps[-1].append((phase, self._now(), self.comm.take_held()))

    def _seconds(self, since: Any, until: Any) -> float:
        if self.device.type == "cuda":
            return since.elapsed_time(until) / 1000
        return until - since

    def split(self) -> dict[str, Optional[float]]:
        """Means over the timed steps: forward_s, backward_s, optimizer_s, exposed_comm_s and step_s."""
        totals: dict[str, list[float]] = {name: [] for name in (*PHASES, "exposed_comm", "step")}
        for marks in self._steps:
            spent = dict.fromkeys((*PHASES, "exposed_comm"), 0.0)
            for (_, since, _), (phase, until, held) in zip(marks, marks[1:]):
                held_s = self.comm.seconds(held)
                spent[phase] += self._seconds(since, until) - held_s
                spent["exposed_comm"] += held_s
            if marks[-1][0] != "optimizer":
                continue  # a step cut short
            for name, value in spent.items():
                totals[name].append(value)
            totals["step"].append(self._seconds(marks[0][1], marks[-1][1]))
        return {f"{name}_s": statistics.fmean(values) if values else None for name, values in totals.items()}
