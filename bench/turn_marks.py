"""What a run's ranks marked on their GPUs (per_rank's set_up_from/until and measuring_from/until, by
node and GPU UUID): whether two trials' turns overlapped, and where the time from the first set-up to
the last measuring went. For sweep_bench.py."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import pandas as pd
from common import ROOT

sys.path.insert(0, str(ROOT))

from ray_zero.store import load_trials  # noqa: E402


def _gpu_marks(folder: Path) -> Iterator[tuple[tuple, str, dict]]:
    """(GPU, trial, rank) for every rank of the run that measured on a GPU."""
    for row in load_trials(folder):
        for rank in row.get("per_rank") or []:
            if rank.get("measuring_from") and rank.get("memory_kind") == "cuda":
                yield (rank.get("node_id"), rank.get("device_uuid")), row["trial"], rank


def measuring_overlaps(folder: Path) -> list[tuple[str, str]]:
    """Pairs of trials of one run where one measured on a GPU while the other measured or set up on it:
    what the measurement turn forbids."""
    measuring, busy = [], []
    for device, trial, rank in _gpu_marks(folder):
        measuring.append((device, rank["measuring_from"], rank["measuring_until"], trial))
        busy.append((device, rank["measuring_from"], rank["measuring_until"], trial))
        if rank.get("set_up_from"):
            busy.append((device, rank["set_up_from"], rank["set_up_until"], trial))
    return sorted(
        {
            (trial, other)
            for device, start, end, trial in measuring
            for other_device, other_start, other_end, other in busy
            if device == other_device and trial != other and start < other_end and other_start < end
        }
    )


def turn_timeline(runs: dict[str, list[Path]]) -> pd.DataFrame:
    """Per run and GPU: seconds from the first set-up to the first measuring, the trials' measuring
    windows added up, the GPU idle between one window and the next, and the whole span (their sum): where
    a side-by-side sweep's time goes once its trials have started."""
    table = []
    for folder in runs["old"] + runs["new"]:
        windows, set_ups = defaultdict(list), defaultdict(list)
        for device, _, rank in _gpu_marks(folder):
            windows[device].append((rank["measuring_from"], rank["measuring_until"]))
            if rank.get("set_up_from"):
                set_ups[device].append(rank["set_up_from"])
        for gpu, device in enumerate(windows):
            mine, first = sorted(windows[device]), min(set_ups[device], default=windows[device][0][0])
            between = sum(max(0.0, b[0] - a[1]) for a, b in zip(mine, mine[1:]))
            table.append(
                {
                    "run": folder.name,
                    "gpu": gpu,
                    "trials": len(mine),
                    "to_first_turn_s": round(mine[0][0] - first, 1),
                    "measuring_s": round(sum(end - start for start, end in mine), 1),
                    "between_turns_s": round(between, 1),
                    "span_s": round(mine[-1][1] - first, 1),
                }
            )
    return pd.DataFrame(table)
