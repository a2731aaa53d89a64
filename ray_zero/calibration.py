"""Activation memory for a model ray_zero has never seen, measured: a short calibration before the grid.

The memory model knows what each engine keeps for the model states; what one micro-batch keeps for
backward depends on the model's code. Two real trials measure it: one rank, DeepSpeed stage 0, at two
small micro-batches outside the grid (1 and 2 unless the grid has them); each rank measures how far one
micro-batch's forward and backward raise allocated memory above what was allocated before it (GPU;
`micro_batch_rise_bytes`) and the bytes autograd saved for backward (any device). The difference
between the two micro-batches, per sample, is the figure: what the forward and backward of one sample
needs, gradients and the step's buffers cancelling out. Every other row of the grid is predicted from
it (`calibration.json` in the output folder; `estimate --calibration DIR` reads it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from ray_zero.config import Experiment, Point
from ray_zero.store import atomic_write

CALIBRATION_FILE = "calibration.json"


def wanted(experiment: Experiment, use_gpu: bool) -> bool:
    """Calibrate a model that is not a preset, on GPU (where the peak is predicted) unless told otherwise."""
    if experiment.calibrate == "auto":
        return use_gpu and not experiment.is_preset()
    return experiment.calibrate == "true"


def calibration_points(experiment: Experiment) -> list[Point]:
    """Stage 0, one worker, two micro-batches outside the grid where it can (the smallest free sizes),
    with and without activation checkpointing as the grid asks."""
    grid_sizes = set(experiment.grid.micro_batch_size)
    free = [size for size in range(1, 1025) if size not in grid_sizes][:2]
    return [Point("deepspeed", 0, size, 1, checkpointing)
            for checkpointing in sorted(set(experiment.grid.activation_checkpointing)) for size in free]


def per_sample_bytes(rows: list[dict[str, Any]], on_gpu: bool) -> dict[str, Optional[float]]:
    """Bytes per sample, plain and checkpointed, from the calibration rows (two micro-batches each)."""
    key = "micro_batch_rise_bytes_per_rank_max" if on_gpu else "saved_for_backward_bytes_per_rank_max"
    result: dict[str, Optional[float]] = {}
    for checkpointing, name in ((False, "plain"), (True, "checkpointed")):
        points = sorted((r["micro_batch_size"], r.get(key)) for r in rows if r.get("status") == "ok"
                        and bool(r.get("activation_checkpointing")) == checkpointing and r.get(key) is not None)
        if len(points) >= 2:
            (small, low), (large, high) = points[0], points[-1]
            result[name] = max(high - low, 0.0) / (large - small)
    return result


def write_calibration(output_dir: Path, experiment: Experiment, rows: list[dict[str, Any]], on_gpu: bool,
                      precision: str) -> dict:
    calibration = {
        "model": experiment.model, "model_config": experiment.model_options, "seq_len": experiment.seq_len,
        "precision": precision, "device": "cuda" if on_gpu else "cpu",
        "measured": "micro_batch_rise_bytes (GPU allocator)" if on_gpu else "saved_for_backward_bytes (autograd)",
        "bytes_per_sample": per_sample_bytes(rows, on_gpu),
        "trials": [{k: r.get(k) for k in ("trial", "status", "micro_batch_size", "activation_checkpointing",
                                          "micro_batch_rise_bytes_per_rank_max", "saved_for_backward_bytes_per_rank_max",
                                          "error")} for r in rows],
    }
    atomic_write(output_dir / CALIBRATION_FILE, json.dumps(calibration, indent=2))
    return calibration
