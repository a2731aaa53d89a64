"""The results' schema and how a row is made: a trial's identity, all ranks' reports aggregated, the
memory model's prediction beside them. Pure: no Ray, no torch, so `report` rebuilds tables anywhere.

Three tiers: `COLUMNS` (results.csv, one row per trial, what a user reads), `PER_RANK_COLUMNS`
(per_rank.csv, each rank's memory after each phase, model-state bytes, timings) and, only with
`--diagnostics`, diagnostics.csv (host threads, scheduler, pids, time marks). trials.jsonl keeps every
field of every row.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ray_zero.measure import partitions
from ray_zero.measure.memory_model import HELD_COLUMNS, predict_point
from ray_zero.measure.prediction import GIB

COLUMNS = [
    "trial",
    "backend",
    "stage",
    "micro_batch_size",
    "num_workers",
    "activation_checkpointing",
    "offload_optimizer",
    "precision",
    "model",
    "params",
    "dataset",
    "steps",
    "status",
    "loss_first",
    "loss_last",
    "samples_per_s",
    "samples_per_s_per_worker",
    "mfu",
    "peak_allocated_gib_max",
    "peak_reserved_gib_max",
    "memory_kind",
    "optimizer_state_bytes_per_rank_max",
    "measured_model_state_gib",
    "predicted_model_state_gib",
    "predicted_peak_gib",
    "measured_over_predicted",
    "prediction",
    "wall_s",
    "attempts",
    "error",
]
"""results.csv, in this order. memory_kind says what the memory columns are: cuda (the CUDA allocator's
peak, per rank) or cpu_rss (each worker process's peak resident set, Python, torch and Ray included)."""
PER_RANK_COLUMNS = [
    "trial",
    "rank",
    "attempt",
    "node_id",
    "device_name",
    "device_memory_gib",
    "memory_kind",
    "memory_after_model_gib",
    "memory_after_data_gib",
    "memory_after_initialize_gib",
    "memory_after_first_backward_gib",
    "memory_after_first_step_gib",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "timed_peak_allocated_gib",
    "nvml_used_gib",
    "parameter_bytes",
    "gradient_bytes",
    "master_param_bytes",
    "optimizer_state_bytes",
    "other_optimizer_bytes",
    "data_bytes",
    "saved_for_backward_bytes",
    "micro_batch_rise_bytes",
    "loss_first",
    "loss_last",
    "loss_by_epoch",
    "samples_per_s",
    "window_samples_per_s_median",
    "window_samples_per_s_p90",
    "tflops",
    "mfu",
    "steps",
    "timed_steps",
    "model_build_s",
    "data_load_s",
    "initialize_s",
    "turn_wait_s",
    "warmup_s",
    "timed_s",
    "data_source",
]
SORT_KEYS = [
    "backend",
    "stage",
    "activation_checkpointing",
    "offload_optimizer",
    "micro_batch_size",
    "num_workers",
]
STATE_KEYS = ("parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes")
# Per-rank figures kept as max and min over ranks (memory is never rank 0's alone).
_MAX_MIN = (
    "peak_allocated_gib",
    "peak_reserved_gib",
    "timed_peak_allocated_gib",
    "nvml_used_gib",
    *STATE_KEYS,
    "other_optimizer_bytes",
    "data_bytes",
    "saved_for_backward_bytes",
    "micro_batch_rise_bytes",
)


def _numbers(per_rank: list[dict], key: str) -> list[float]:
    return [
        r[key]
        for r in per_rank
        if isinstance(r.get(key), (int, float))
        and not isinstance(r.get(key), bool)
        and not math.isnan(r[key])
    ]


def _column(key: str) -> str:
    return f"{key}_per_rank" if key.endswith("_bytes") else key


def aggregate_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Max and min over ranks for memory, sum over ranks for throughput, mean over ranks for loss."""
    row: dict[str, Any] = {}
    for key in _MAX_MIN:
        values = _numbers(per_rank, key)
        row[f"{_column(key)}_max"] = max(values) if values else None
        row[f"{_column(key)}_min"] = min(values) if values else None
    rates = _numbers(per_rank, "samples_per_s")
    row["samples_per_s"] = sum(rates) if rates else None
    row["samples_per_s_per_worker"] = sum(rates) / len(rates) if rates else None
    for key in ("window_samples_per_s_median", "window_samples_per_s_p90"):
        values = _numbers(per_rank, key)
        row[key] = sum(values) if values and len(values) == len(per_rank) else None
    for key in ("loss_first", "loss_last", "tflops", "mfu"):
        values = _numbers(per_rank, key)
        row[key if key.startswith("loss") or key == "mfu" else "tflops_per_worker"] = (
            sum(values) / len(values) if values else None
        )
    epochs = [r.get("loss_by_epoch") or [] for r in per_rank]
    if epochs and epochs[0] and all(len(e) == len(epochs[0]) for e in epochs):
        row["loss_by_epoch"] = [round(sum(column) / len(column), 5) for column in zip(*epochs)]
    first = per_rank[0] if per_rank else {}
    for key in ("steps", "timed_steps", "memory_kind", "data_source", "device_name", "device_memory_gib"):
        if key in first:  # a rank out of memory reports none: the trial's row keeps its own memory_kind
            row[key] = first[key]
    for key in ("model_build_s", "data_load_s", "initialize_s", "turn_wait_s", "warmup_s", "timed_s"):
        # the slowest rank
        values = _numbers(per_rank, key)
        row[key] = max(values) if values else None
    return row


def trial_row(spec) -> dict[str, Any]:
    """What is known of a trial (a config.TrialSpec) before it runs: its grid point and settings."""
    experiment, point = spec.experiment, spec.point
    return {
        "trial": spec.name,
        "backend": point.backend,
        "stage": point.stage,
        "micro_batch_size": point.micro_batch_size,
        "num_workers": point.num_workers,
        "activation_checkpointing": point.activation_checkpointing,
        "offload_optimizer": point.offload_optimizer,
        "precision": spec.precision,
        "model": experiment.model,
        "params": spec.model.params,
        "param_bytes": spec.model.param_bytes,
        "dataset": experiment.resolved_dataset(),
        "steps": experiment.steps,
        "global_batch": experiment.global_batch(point.micro_batch_size, point.num_workers),
        "memory_kind": "cuda" if spec.use_gpu else "cpu_rss",
        "reduce_bucket_size": experiment.reduce_bucket_size,
        "flops_per_sample": spec.model.flops_per_sample,
        "largest_block_params": spec.model.largest_block_params,
        "gpu_share": spec.gpu_share if spec.use_gpu else None,
        **_held(spec.model, point),
    }


def _held(model, point) -> dict[str, Any]:
    """What the point's engine leaves on its fullest rank, in elements, from the parameters' shapes
    (ray_zero/partitions.py); nothing for a description without shapes (earlier versions)."""
    if not (getattr(model, "trainable_param_shapes", ()) or getattr(model, "frozen_param_shapes", ())):
        return {}
    held = partitions.held(
        model.trainable_param_shapes, model.frozen_param_shapes, point.backend, point.stage, point.num_workers
    )
    return dict(zip(HELD_COLUMNS, (held.params, held.gradients, held.states, held.trainable)))


def one_line_reason(error: BaseException) -> str:
    """The informative part of a (possibly wrapped, multi-line) worker error, on one line."""
    lines = [line.strip() for line in (str(error).strip() or type(error).__name__).splitlines()]
    lines = [
        line
        for line in lines
        if line
        and not line.startswith(("Training failed due to worker errors", "Traceback", "[Rank", "File ", "^"))
    ]
    reason = lines[0] if lines else type(error).__name__
    died = next(
        (line for line in lines if "worker process has died" in line or "killed" in line.lower()), None
    )
    if died and died != reason:
        reason = f"{reason} {died}"
    return reason[:400]


def _out_of_memory(error: BaseException) -> Optional[dict]:
    """The memory at the failure if `error` is (or wraps) ray_zero's TrialOutOfMemory; {} for another
    out-of-memory error; None otherwise. By name: this module imports no torch."""
    for candidate in (error, getattr(error, "cause", None), getattr(error, "__cause__", None)):
        if type(candidate).__name__ == "TrialOutOfMemory":
            return candidate.memory
    return {} if "out of memory" in str(error).lower() else None


def failed_row_fields(failures: dict[Any, BaseException]) -> dict[str, Any]:
    """status, error and (for out-of-memory) the memory at the failure, from each rank's error."""
    for worker_error in failures.values():  # any rank out of memory makes the trial an oom row
        memory = _out_of_memory(worker_error)
        if memory is not None:
            row = {"status": "oom", "error": one_line_reason(worker_error)}
            if memory:
                row.update(
                    peak_allocated_gib_max=memory.get("peak_allocated_gib"),
                    peak_reserved_gib_max=memory.get("peak_reserved_gib"),
                )
            return row
    rank, worker_error = next(iter(failures.items()))
    where = f"rank {rank}: " if rank is not None else ""
    return {"status": "failed", "error": where + one_line_reason(worker_error)}


def finish_row(row: dict[str, Any], calibration: Optional[dict] = None) -> dict[str, Any]:
    """Prediction and comparison columns, every column present, in table order."""
    for key, default in (
        ("backend", "deepspeed"),
        ("activation_checkpointing", False),
        ("offload_optimizer", "none"),
    ):
        row.setdefault(key, default)  # rows of earlier versions: DeepSpeed only
    prediction = predict_point(row, calibration)
    row["predicted_model_state_gib"] = prediction.model_state_bytes / GIB
    row["predicted_peak_gib"] = prediction.peak_bytes / GIB if prediction.peak_bytes is not None else None
    row["prediction"] = prediction.basis
    measured = [row.get(f"{key}_per_rank_max") for key in STATE_KEYS]
    if all(isinstance(v, (int, float)) for v in measured):
        row["measured_model_state_gib"] = sum(measured) / GIB
    peak, predicted = row.get("peak_allocated_gib_max"), row.get("predicted_peak_gib")
    # Only a finished trial reached its peak (an oom row holds the memory at the failure), and on CPU the
    # peak is the resident set (Python, torch and Ray included): no like-for-like ratio for those.
    row["measured_over_predicted"] = None
    if row.get("status") == "ok" and row.get("memory_kind") == "cuda" and peak and predicted:
        row["measured_over_predicted"] = peak / predicted
    return {column: row.get(column) for column in COLUMNS} | {
        k: v for k, v in row.items() if k not in COLUMNS
    }


def skipped_row(spec, reason: str) -> dict[str, Any]:
    row = trial_row(spec)
    row.update(status="skipped", error=reason)
    return finish_row(row)
