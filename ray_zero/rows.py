"""How a row is made: a trial's identity, all ranks' reports aggregated as the column registry says
(ray_zero/schema/), the memory model's prediction beside them. Pure: no Ray, no torch, so `report`
rebuilds tables anywhere.

Three tiers: `COLUMNS` (results.csv, one row per trial, what a user reads), `PER_RANK_COLUMNS`
(per_rank.csv, each rank's memory after each phase, model-state bytes, timings) and, only with
`--diagnostics`, diagnostics.csv (host threads, scheduler, pids, time marks). trials.jsonl keeps every
field of every row.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ray_zero.measure import comm_model, partitions
from ray_zero.measure.memory_model import HELD_COLUMNS, predict_point
from ray_zero.measure.prediction import GIB
from ray_zero.schema import RANK, TRIAL


def results_columns() -> list[str]:
    """results.csv's columns, in order (ray_zero/schema/trial_columns.py; read at each call, so a column
    renamed there is renamed here). memory_kind says what the memory columns are: cuda (the CUDA
    allocator's peak, per rank) or cpu_rss (each worker process's peak resident set)."""
    return TRIAL.names("results")


def per_rank_columns() -> list[str]:
    """per_rank.csv's columns, in order (ray_zero/schema/rank_columns.py)."""
    return RANK.names("per_rank")


SORT_KEYS = [
    "backend",
    "stage",
    "activation_checkpointing",
    "offload_optimizer",
    "micro_batch_size",
    "num_workers",
]
STATE_KEYS = ("parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes")
_LEAVE = object()
"""An aggregate with nothing to say: the row keeps its own value (a rank out of memory reports none)."""


def _numbers(per_rank: list[dict], key: str) -> list[float]:
    return [
        r[key]
        for r in per_rank
        if isinstance(r.get(key), (int, float))
        and not isinstance(r.get(key), bool)
        and not math.isnan(r[key])
    ]


def _fullest(per_rank: list[dict]) -> Optional[float]:
    """The model states (GiB) of the rank that holds the most of them, among ranks that counted all four
    kinds."""
    totals = [sum(r[k] for k in STATE_KEYS) for r in per_rank if all(_numbers([r], k) for k in STATE_KEYS)]
    return max(totals) / GIB if totals else None


def _aggregate(how: str, key: str, per_rank: list[dict]) -> Any:
    if how in ("first", "epochs"):
        first = per_rank[0] if per_rank else {}
        if how == "first":
            return first[key] if key in first else _LEAVE
        epochs = [r.get(key) or [] for r in per_rank]
        if epochs and epochs[0] and all(len(e) == len(epochs[0]) for e in epochs):
            return [round(sum(column) / len(column), 5) for column in zip(*epochs)]
        return _LEAVE
    if how == "fullest":
        return _fullest(per_rank)
    if how == "any":
        flags = [r[key] for r in per_rank if isinstance(r.get(key), bool)]
        return any(flags) if flags else None
    values = _numbers(per_rank, key)
    if not values or (how == "sum_all" and len(values) != len(per_rank)):
        return None
    if how in ("sum", "sum_all"):
        return sum(values)
    if how == "mean":
        return sum(values) / len(values)
    return min(values) if how == "min" else max(values)  # max, slowest


def aggregate_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Every trial column made from the ranks' reports, as the registry says (`how` of `of`): max and
    min over ranks for memory, sum over ranks for throughput, mean for loss, the slowest rank's times,
    the fullest rank's model states."""
    row: dict[str, Any] = {}
    for column in TRIAL.columns:
        if column.how:
            value = _aggregate(column.how, column.of, per_rank)
            if value is not _LEAVE:
                row[column.name] = value
    return row


def trial_row(spec) -> dict[str, Any]:
    """What is known of a trial (a config.TrialSpec) before it runs: its grid point and settings."""
    experiment, point = spec.experiment, spec.point
    return {
        "trial": spec.name,
        **point.fields(),
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
        **_comm(spec),
    }


def _held(model, point) -> dict[str, Any]:
    """What the point's engine leaves on its fullest rank, in elements, from the parameters' shapes
    (ray_zero/measure/partitions.py); nothing for a description without shapes (earlier versions)."""
    if not (getattr(model, "trainable_param_shapes", ()) or getattr(model, "frozen_param_shapes", ())):
        return {}
    held = partitions.held(
        model.trainable_param_shapes,
        model.frozen_param_shapes,
        point.backend,
        point.stage,
        point.num_workers,
        getattr(model, "unreached_params", ()),
    )
    return dict(zip(HELD_COLUMNS, (held.params, held.gradients, held.states, held.trainable)))


def _comm(spec) -> dict[str, Any]:
    """The bytes the point's engine sends per step, by collective (ray_zero/measure/comm_model.py)."""
    model = spec.model
    if not (getattr(model, "trainable_param_shapes", ()) or getattr(model, "frozen_param_shapes", ())):
        return {}
    accumulation = spec.experiment.gradient_accumulation_steps
    predicted = comm_model.predict_for(model, spec.point, spec.precision, accumulation)
    return {f"predicted_comm_{kind}_bytes": value for kind, value in predicted.items()}


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


EARLIER_DEFAULTS = {"backend": "deepspeed", "activation_checkpointing": False, "offload_optimizer": "none"}
"""What rows of earlier versions leave out (they ran DeepSpeed only)."""


def finish_row(row: dict[str, Any], calibration: Optional[dict] = None) -> dict[str, Any]:
    """Prediction and comparison columns, every column present, in table order."""
    for key, default in EARLIER_DEFAULTS.items():
        row.setdefault(key, default)
    prediction = predict_point(row, calibration)
    row["predicted_model_state_gib"] = prediction.model_state_bytes / GIB
    row["predicted_peak_gib"] = prediction.peak_bytes / GIB if prediction.peak_bytes is not None else None
    row["prediction"] = prediction.basis
    peak, predicted = row.get("peak_allocated_gib_max"), row.get("predicted_peak_gib")
    # Only a finished trial reached its peak (an oom row holds the memory at the failure), and on CPU the
    # peak is the resident set (Python, torch and Ray included): no like-for-like ratio for those.
    row["measured_over_predicted"] = None
    if row.get("status") == "ok" and row.get("memory_kind") == "cuda" and peak and predicted:
        row["measured_over_predicted"] = peak / predicted
    columns = results_columns()
    return {column: row.get(column) for column in columns} | {
        k: v for k, v in row.items() if k not in columns
    }


def skipped_row(spec, reason: str) -> dict[str, Any]:
    row = trial_row(spec)
    row.update(status="skipped", error=reason)
    return finish_row(row)
