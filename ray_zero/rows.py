"""Table rows from measurements: a trial's identity, all ranks' reports aggregated, the memory model's
prediction beside them. Pure: no Ray, so `report` can rebuild tables anywhere."""
from __future__ import annotations

import math
from typing import Any

from ray_zero.config import Experiment
from ray_zero.memory_model import GIB, predict_row
from ray_zero.report import COLUMNS
from ray_zero.sizes import PRESETS, SAMPLE_BYTES, synthetic_count

# Per-rank measurements aggregated as max and min over ranks (memory is never rank 0's alone).
_MAX_MIN = {
    "peak_allocated_gib": "peak_allocated_gib", "peak_reserved_gib": "peak_reserved_gib",
    "timed_peak_allocated_gib": "timed_peak_allocated_gib", "nvml_used_gib": "nvml_used_gib",
    "optimizer_state_bytes": "optimizer_state_bytes_per_rank", "parameter_bytes": "parameter_bytes_per_rank",
    "gradient_bytes": "gradient_bytes_per_rank", "master_param_bytes": "master_param_bytes_per_rank",
    "other_optimizer_bytes": "other_optimizer_bytes_per_rank", "data_bytes": "data_bytes_per_rank",
}


def trial_name(point: dict[str, int]) -> str:
    return f"stage{point['stage']}_mb{point['micro_batch_size']}_w{point['num_workers']}"


def _numbers(per_rank: list[dict], key: str) -> list[float]:
    return [r[key] for r in per_rank if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]


def aggregate_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Max and min over ranks for memory, sum over ranks for throughput, mean over ranks for loss."""
    row: dict[str, Any] = {}
    for key, column in _MAX_MIN.items():
        values = _numbers(per_rank, key)
        row[f"{column}_max"] = max(values) if values else None
        row[f"{column}_min"] = min(values) if values else None
    rates = _numbers(per_rank, "samples_per_s")
    row["samples_per_s"] = sum(rates) if rates else None
    for key in ("window_samples_per_s_median", "window_samples_per_s_p90"):
        values = _numbers(per_rank, key)
        row[key] = sum(values) if values and len(values) == len(per_rank) else None
    row["samples_per_s_per_worker"] = sum(rates) / len(rates) if rates else None
    for key in ("loss_first", "loss_last"):
        values = _numbers(per_rank, key)
        row[key] = sum(values) / len(values) if values else None
    epochs = [r.get("loss_by_epoch") or [] for r in per_rank]
    if epochs and all(len(e) == len(epochs[0]) for e in epochs) and epochs[0]:
        row["loss_by_epoch"] = [round(sum(col) / len(col), 5) for col in zip(*epochs)]
    tflops = _numbers(per_rank, "tflops")
    row["tflops_per_worker"] = sum(tflops) / len(tflops) if tflops else None
    mfu = _numbers(per_rank, "mfu")
    row["mfu"] = sum(mfu) / len(mfu) if mfu else None
    first = per_rank[0] if per_rank else {}
    for key in ("steps", "timed_steps", "memory_kind", "data_source"):
        row[key] = first.get(key)
    row["device"] = first.get("device_name")
    # Where the trial's time went, slowest rank first: the start-up breakdown of bench/README.md.
    for key in ("model_build_s", "data_load_s", "initialize_s", "warmup_s", "timed_s"):
        values = _numbers(per_rank, key)
        row[key] = max(values) if values else None
    for key, pick in (("process_started_at", max), ("train_started_at", max), ("finished_at", max)):
        values = _numbers(per_rank, key)
        row[key] = pick(values) if values else None
    return row


def base_row(experiment: Experiment, point: dict[str, int], precision: str, use_gpu: bool) -> dict[str, Any]:
    """What is known of a trial before it runs: its grid point and settings."""
    return {
        "stage": point["stage"], "micro_batch_size": point["micro_batch_size"],
        "num_workers": point["num_workers"], "precision": precision, "model": experiment.model,
        "params": PRESETS[experiment.model].param_count(), "dataset": experiment.dataset,
        "steps": experiment.steps, "global_batch": experiment.global_batch(point["micro_batch_size"],
                                                                         point["num_workers"]),
        "memory_kind": "cuda" if use_gpu else "cpu_rss", "reduce_bucket_size": experiment.reduce_bucket_size,
        "trial": trial_name(point),
    }


def _expected_data_bytes(row: dict[str, Any]) -> float:
    """The rank's data shard as reported; before any report, known exactly for synthetic data only."""
    if isinstance(row.get("data_bytes_per_rank_max"), (int, float)):
        return row["data_bytes_per_rank_max"]
    if row["dataset"] == "synthetic":
        accumulation = row["global_batch"] // (row["micro_batch_size"] * row["num_workers"])
        return synthetic_count(row["micro_batch_size"] * accumulation, row["num_workers"]) * SAMPLE_BYTES
    return 0.0


def finish_row(row: dict[str, Any]) -> dict[str, Any]:
    """Prediction and comparison columns, and every column present, in table order."""
    row.update(predict_row(row["model"], row["stage"], row["num_workers"], row["precision"],
                           row["micro_batch_size"], row["reduce_bucket_size"],
                           on_gpu=row["memory_kind"] == "cuda", data_bytes=_expected_data_bytes(row)))
    measured_states = [row.get(f"{k}_per_rank_max") for k in
                       ("parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes")]
    if all(isinstance(v, (int, float)) for v in measured_states):
        row["measured_model_state_gib"] = sum(measured_states) / GIB
    peak, predicted = row.get("peak_allocated_gib_max"), row.get("predicted_peak_gib")
    # Only a finished trial reached its peak (an oom row holds the memory at the failure), and on CPU
    # the peak is the resident set (Python, torch, Ray included): no like-for-like ratio for those.
    row["measured_over_predicted"] = None
    if row.get("status") == "ok" and row["memory_kind"] == "cuda" and peak and predicted:
        row["measured_over_predicted"] = peak / predicted
    return {column: row.get(column) for column in COLUMNS} | {
        k: v for k, v in row.items() if k not in COLUMNS}
