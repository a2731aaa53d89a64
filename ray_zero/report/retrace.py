"""`report DIR --predict`: a folder's rows given the traced activations of this version, its model's step
traced again on the meta device from the folder's experiment.yaml (ray_zero/train/grid_trace.py).
Rows of a CPU sweep, and rows whose step cannot be traced, keep what they had."""

from __future__ import annotations

from typing import Any

from ray_zero.config import Point
from ray_zero.experiment_file import validate_experiment
from ray_zero.rows import EARLIER_DEFAULTS, traced_fields
from ray_zero.train.grid_trace import trace_grid, trace_key


def retraced(rows: list[dict[str, Any]], experiment: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """`rows` with this version's traced figures (their GPU rows), ready to be predicted again."""
    gpu = [{**EARLIER_DEFAULTS, **row} for row in rows if row.get("memory_kind") == "cuda"]
    if not gpu or not experiment:
        return rows
    loaded = model_experiment(experiment, source)
    points = {
        (row["precision"], Point(row["backend"], row["stage"], row["micro_batch_size"], row["num_workers"],
                                 bool(row["activation_checkpointing"]), row["offload_optimizer"],
                                 row.get("seq_len")))
        for row in gpu
    }  # fmt: skip
    traces = {
        precision: trace_grid(loaded.model_source(), [pt for p, pt in points if p == precision], precision)
        for precision in {p for p, _ in points}
    }
    accumulation = loaded.gradient_accumulation_steps
    out = []
    for row in rows:
        if row.get("memory_kind") == "cuda":
            full = {**EARLIER_DEFAULTS, **row}
            key = trace_key(
                full["backend"], full["precision"], full["activation_checkpointing"], full.get("seq_len")
            )
            row = {**row, **traced_fields(full, traces[full["precision"]][key], accumulation)}
        out.append(row)
    return out


MODEL_KEYS = ("model", "model_config", "seq_len", "input_shape", "num_classes", "gradient_accumulation_steps")


def model_experiment(experiment: dict[str, Any], source: str):
    """An Experiment of a folder's model alone (what tracing needs): the keys of earlier versions' files
    that this version no longer takes are left out."""
    kept = {key: experiment[key] for key in MODEL_KEYS if experiment.get(key) is not None}
    return validate_experiment({**kept, "steps": 2, "warmup_steps": 1}, source=source)
