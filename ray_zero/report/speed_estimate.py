"""`estimate --measured DIR`: samples/s at each worker count, predicted from a sweep's measured rows with
the bus bandwidth (ray_zero/measure/speed_model.py), beside what the sweep measured at that count.

Each engine, stage, micro-batch and precision is predicted from its row of fewest workers (the one whose
split says the least about communication it did not have); a row measured at the target count stands
beside its prediction, and a target nobody measured says so in `measured`.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from ray_zero.config import ConfigError, is_calibration
from ray_zero.measure.bandwidth import Bandwidth, given, read_bandwidth
from ray_zero.measure.speed_model import predict_speed
from ray_zero.rows import EARLIER_DEFAULTS
from ray_zero.store import has_trials

BANDWIDTH_FILE = "bandwidth.json"
"""A sweep folder's bandwidth file (`python -m ray_zero bandwidth --output DIR/bandwidth.json`): with it, the
report predicts samples/s at other worker counts beside the measured ones."""
KEY = ("backend", "stage", "micro_batch_size", "precision", "activation_checkpointing")


def _key(row: dict) -> tuple:
    return tuple(row.get(k) if row.get(k) is not None else EARLIER_DEFAULTS.get(k) for k in KEY)


def _has_split(row: dict) -> bool:
    step = row.get("step_s")
    return step is not None and step == step and step > 0


def speed_table(
    rows: list[dict],
    model,
    workers: Sequence[int],
    bandwidth: Bandwidth,
    bucket_elements: float,
    accumulation: int = 1,
) -> pd.DataFrame:
    """A row per measured configuration and worker count: the predicted step, its band and samples/s, and
    the measured samples/s where the sweep has that point."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for row in rows:  # the grid's points: calibration trials measure memory in a few steps
        if row.get("status") == "ok" and not is_calibration(row.get("trial", "")):
            by_key.setdefault(_key(row), {})[int(row["num_workers"])] = row
    table = []
    for key, measured in sorted(by_key.items(), key=lambda item: tuple(str(v) for v in item[0])):
        # rows of earlier versions have no step split: they stand as measured, never predicted from
        split = [n for n, row in measured.items() if _has_split(row)]
        if not split:
            continue
        base_workers = min(split)
        base = measured[base_workers]
        for n in sorted(set(workers) | set(measured)):
            speed = predict_speed(model, base, n, bandwidth, bucket_elements, accumulation)
            if speed is None:
                continue
            there = measured.get(n)
            table.append(
                {
                    "backend": base["backend"],
                    "stage": base["stage"],
                    "micro_batch": base["micro_batch_size"],
                    "from_workers": base_workers,
                    "workers": n,
                    "comm_gb": sum(speed.comm_bytes.values()) / 1e9,
                    "compute_ms": speed.compute_s * 1e3,
                    "optimizer_ms": speed.optimizer_s * 1e3,
                    "comm_ms": speed.comm_s * 1e3,
                    "step_ms": speed.step_s * 1e3,
                    "samples_per_s": speed.samples_per_s,
                    "samples_per_s_band": f"{speed.samples_per_s_low:.4g}-{speed.samples_per_s_high:.4g}",
                    "per_worker": speed.samples_per_s_per_worker,
                    "measured": float(there["samples_per_s"]) if there else None,
                    "error": speed.samples_per_s / float(there["samples_per_s"]) - 1 if there else None,
                }
            )
    return pd.DataFrame(table)


def speed_head(bandwidth: Bandwidth, folder) -> str:
    return (
        f"Speed predicted from {folder}'s rows (each from its row of fewest workers) at {bandwidth.source}: "
        "step = compute + optimizer (scaled by the optimizer states each rank steps) + communication "
        "(bytes x bus factor / busbw), less what the row showed hidden; the band runs from no overlap to "
        "full overlap. measured: the sweep's samples/s at that point (blank: not measured); error: "
        "predicted over measured, less 1."
    )


def folder_speed(folder: Path, rows: list[dict], saved: dict) -> Optional[tuple[str, pd.DataFrame]]:
    """The report's speed table for a sweep folder holding BANDWIDTH_FILE, from its rows and the model as
    the sweep described it (experiment.yaml); None without the file or a row with a step split."""
    path = Path(folder) / BANDWIDTH_FILE
    model, experiment = saved.get("model"), saved.get("experiment") or {}
    if not path.is_file() or not model or "trainable_param_shapes" not in model:
        return None
    # Named by its file name, not its absolute path: the page is the same bytes wherever it is drawn.
    bandwidth = read_bandwidth(path, BANDWIDTH_FILE)
    measured = {int(r["num_workers"]) for r in rows if r.get("status") == "ok"}
    frame = speed_table(
        rows,
        types.SimpleNamespace(**model),  # the description's fields, as ModelInfo had them
        sorted(measured | {1, 2, 4, 8}),
        bandwidth,
        experiment.get("reduce_bucket_size", 5e7),
        experiment.get("gradient_accumulation_steps", 1),
    )
    return (speed_head(bandwidth, Path(folder).name), frame) if len(frame) else None


def speed_source(measured, bandwidth, busbw, profile=None) -> Optional[Bandwidth]:
    """`estimate`'s bandwidth: for a speed prediction from `measured` rows (needed there), or for the
    communication of a step predicted on `profile` (without one there, communication is not counted);
    None without either. Bad combinations are one line each."""
    if measured is None and profile is None:
        if bandwidth is not None or busbw is not None:
            raise ConfigError(
                "--bandwidth and --busbw go with --measured DIR (a sweep's folder to predict from) or "
                "--profile FILE (a GPU's profile)"
            )
        return None
    if measured is not None and not has_trials(Path(measured)):
        raise ConfigError(f"--measured {measured}: no trials.jsonl there (give a sweep's output folder)")
    neither = bandwidth is None and busbw is None
    if (bandwidth is not None and busbw is not None) or (measured is not None and neither):
        what = "--measured" if measured is not None else "--profile"
        raise ConfigError(
            f"{what}: give one of --bandwidth FILE (from `python -m ray_zero bandwidth`) or --busbw GB/s"
        )
    if neither:
        return None
    return read_bandwidth(Path(bandwidth)) if bandwidth is not None else given(busbw)
