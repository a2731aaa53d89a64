"""The sweep's record of its trials' ranks, one actor for the whole sweep (looked up by name): each rank's
attempts, node and process, the phase it is in, the time it waited for its GPU's turn, every all-rank
report, which trials were stopped for running past their bound (ray_zero/run/watchdog.py), and the
corrections its trials' misses ask of the later ones (ray_zero/measure/correction.py)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional

import ray

from ray_zero.measure.correction import Correction, Corrections
from ray_zero.train.turn import TURN_WAIT  # waiting for the GPU's turn: not counted against the bound


@ray.remote(num_cpus=0)
class TrialLog:
    """By trial key (ray_zero/run/trial.py builds it): what the trial's ranks said."""

    def __init__(self):
        self._starts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._reports: dict[str, list[list[dict]]] = defaultdict(list)
        self._received: dict[str, int] = defaultdict(int)
        self._ranks: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        self._processes: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        self._stopped: set[str] = set()
        self._corrections = Corrections()

    def process_started(self, trial: str, node_id: str, pid: int) -> None:
        """A worker process of the trial started (Ray Train gives it a rank later): the trial's bound counts
        from here, and a process that never reaches its training function is stopped like a rank."""
        now = time.time()
        self._processes[trial][pid] = {
            "node_id": node_id,
            "pid": pid,
            "started_at": now,
            "phase": "worker started, before its training function",
            "phase_since": now,
            "waited_s": 0.0,
        }

    def started(self, trial: str, rank: int, node_id: Optional[str] = None, pid: Optional[int] = None) -> int:
        """A rank began (its attempt number): where it runs, and since when."""
        self._starts[trial][rank] += 1
        self._ranks[trial][rank] = {
            "node_id": node_id,
            "pid": pid,
            "started_at": time.time(),
            "phase": "start",
            "phase_since": time.time(),
            "waited_s": 0.0,
        }
        return self._starts[trial][rank]

    def phase(self, trial: str, rank: int, phase: str) -> None:
        """A rank entered `phase`; the time it spent waiting for its GPU's turn is added up."""
        mine = self._ranks[trial].get(rank)
        if mine is None:
            return
        now = time.time()
        if mine["phase"] == TURN_WAIT:
            mine["waited_s"] += now - mine["phase_since"]
        mine.update(phase=phase, phase_since=now)

    def progress(self, trial: str) -> Optional[dict[str, Any]]:
        """The trial's own time so far (since its first rank began, less rank 0's waits for the GPU's turn;
        before any rank, since its first worker process started), each rank's phase, node and process, and
        the worker processes without a rank (by pid); None before any began."""
        ranks, processes = self._ranks.get(trial) or {}, self._processes.get(trial) or {}
        if not ranks and not processes:
            return None
        now = time.time()
        first = ranks.get(0) or next(iter(ranks.values()), None)
        waited = (
            first["waited_s"] + (now - first["phase_since"] if first["phase"] == TURN_WAIT else 0.0)
            if first
            else 0.0
        )
        began = min(r["started_at"] for r in (ranks or processes).values())
        ranked = {r["pid"] for r in ranks.values()}
        return {
            "own_s": now - began - waited,
            "ranks": {rank: dict(r) for rank, r in ranks.items()},
            "processes": {pid: dict(p) for pid, p in processes.items() if pid not in ranked},
        }

    def stop(self, trial: str) -> None:
        """The trial ran past its bound: a rank that starts for it now (a retry) gives up at once."""
        self._stopped.add(trial)

    def stopped(self, trial: str) -> bool:
        return trial in self._stopped

    def reported(self, trial: str, ranks: list[dict]) -> None:
        self._reports[trial].append(ranks)
        self._received[trial] += 1

    def reports_received(self, trial: str) -> int:
        """All-rank reports of `trial` received so far, every run of it (fit's ranks wait on it)."""
        return self._received[trial]

    def take(self, trial: str) -> tuple[Optional[list[dict]], int]:
        """The last all-rank report and the number of attempts that started, forgotten after."""
        starts = self._starts.pop(trial, {})
        reports = self._reports.pop(trial, [])
        self._received.pop(trial, None)
        self._ranks.pop(trial, None)
        self._processes.pop(trial, None)
        self._stopped.discard(trial)
        return (reports[-1] if reports else None), max(starts.values(), default=0)

    def missed(self, correction: Correction) -> None:
        """A trial measured above its prediction's band: the later trials of its engine are planned with
        the term it measured."""
        self._corrections.add(correction)

    def corrections(self) -> Corrections:
        return self._corrections

    def take_reports(self, trial: str) -> list[list[dict]]:
        """Every all-rank report since the last call (a search reports once per probe), forgotten after."""
        return self._reports.pop(trial, [])


def trial_log(name: str):
    """The sweep's log, on the sweep's own node (the driver's): placed anywhere else (it needs no CPU), it
    died with a lost worker node, and every later trial of the sweep failed at its first look-up
    (bench/chaos.md)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return TrialLog.options(name=name, get_if_exists=True, lifetime=None, scheduling_strategy=here).remote()
