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

from ray_zero.measure import comm_model, error_band, partitions
from ray_zero.measure.memory_model import HELD_COLUMNS, engine_for_row, predict_point
from ray_zero.measure.point_speed import speed_fields
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
    """What is known of a trial (a config.TrialSpec) before it runs: its grid point and settings, the
    memory model's prediction for it, made here once (`prediction_fields`), and its step time on the
    profile the spec carries (measure/point_speed.speed_fields)."""
    row = _point_row(spec)
    row.update(_traced(spec, row))
    row.update(prediction_fields(row, getattr(spec, "calibration", None)))
    row.update(speed_fields(spec))
    return row


def _point_row(spec) -> dict[str, Any]:
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
        "sample_bytes": getattr(spec.model, "sample_bytes", None),
        "band_class": error_band.class_of_info(spec.model),
        "gpu_share": spec.gpu_share if spec.use_gpu else None,
        **_held(spec.model, point),
        **_comm(spec),
    }


def _traced(spec, row: dict[str, Any]) -> dict[str, Any]:
    """The point's traced step (spec.activations, ray_zero/train/grid_trace.py) for this engine, or why it
    was not traced; nothing where it was not traced (CPU)."""
    traced = getattr(spec, "activations", None)
    if traced is None or not spec.use_gpu:
        return {}
    return traced_fields(row, traced, spec.experiment.gradient_accumulation_steps)


def traced_fields(row: dict[str, Any], traced, accumulation: int = 1) -> dict[str, Any]:
    """What one micro-batch adds to the memory of the row's rank, from its traced step (a grid_trace.Traced,
    or why there is none): the step's peak with the gradients the engine holds by the end of backward
    (none where it writes them into buffers allocated before the step: ZeRO-3)."""
    if isinstance(traced, str):
        return {"trace_note": traced}
    engine = engine_for_row({**EARLIER_DEFAULTS, **row})
    held = engine.gradient_bytes if engine.gradients_freed_in_step else 0.0
    micro = row["micro_batch_size"]
    rise = traced.rise(micro, held)
    if accumulation > 1 and engine.gradients_freed_in_step:
        rise = max(rise, traced.rise(micro, 0.0) + held)  # later micro-batches: the gradients exist already
    step = traced.at(micro) or traced.steps[-1]
    return {
        "traced_activation_bytes": rise,
        "trace_form": step.form + (", checkpointed" if step.checkpointing else ""),
        "trace_attention": ", ".join(f"{kind} x{count}" for kind, count in step.attention) or "none",
        "trace_peak_ops": ", ".join(f"{op} {size / GIB:.3g}" for op, size in step.composition[:5]),
    }


def prediction_fields(row: dict[str, Any], calibration: Optional[dict] = None) -> dict[str, Any]:
    """The memory model's prediction of a row, term by term (GiB), with its basis and where its
    activations came from (ray_zero/measure/memory_model.py); beside a traced row's, with a calibration,
    the calibrated peak (a check)."""
    row = {**EARLIER_DEFAULTS, **row}
    prediction = predict_point(row, calibration)
    peak = prediction.peak_bytes
    fields = {
        "predicted_model_state_gib": prediction.model_state_bytes / GIB,
        "predicted_peak_gib": peak / GIB if peak is not None else None,
        "prediction": prediction.basis,
        "activation_source": _source(prediction, row),
        **{f"predicted_{name}_gib": _gib(getattr(prediction, f"{name}_bytes")) for name in TERMS},
    }
    if calibration and row.get("traced_activation_bytes") is not None and row.get("memory_kind") == "cuda":
        check = predict_point(row, calibration, traced=False)
        fields["calibrated_activation_gib"] = _gib(check.activation_bytes)
        fields["predicted_peak_calibrated_gib"] = _gib(check.peak_bytes)
    return fields | band_fields({**row, **fields})


def band_fields(row: dict[str, Any], gpu: Optional[str] = None) -> dict[str, Any]:
    """The predicted peak's error band (ray_zero/measure/error_band.py) for the row's model class, checked
    against the running torch and the GPU (`gpu`, else the row's measured device), and whether the
    measured peak of an ok row lies inside it."""
    peak = row.get("predicted_peak_gib")
    if row.get("memory_kind") != "cuda" or peak is None:
        return {}
    name = row.get("band_class") or error_band.class_of_model(str(row.get("model") or ""))
    band = error_band.band_for(name, gpu or row.get("device_name"))
    ratio = row.get("measured_over_predicted")
    return {
        "band_class": name,
        "predicted_band": str(band),
        "predicted_peak_high_gib": band.high_gib(peak),
        "inside_band": band.holds(ratio) if isinstance(ratio, (int, float)) else None,
    }


TERMS = (
    "parameter", "gradient", "master_param", "optimizer_state", "bucket", "step_transient", "compute",
    "activation", "workspace", "data",
)  # fmt: skip
"""The prediction's terms (Prediction's *_bytes fields), each stored in the row as predicted_*_gib."""


def _gib(value: Optional[float]) -> Optional[float]:
    return value / GIB if value is not None else None


def _source(prediction, row: dict[str, Any]) -> str:
    """traced, calibrated, preset shapes, or none (why)."""
    if row.get("memory_kind") != "cuda":
        return "none (CPU rows: model states only)"
    if prediction.activation_bytes is None:
        return f"none ({row.get('trace_note') or prediction.basis})"
    for words, name in (("traced", "traced"), ("calibrated", "calibrated")):
        if words in prediction.basis:
            return name
    return "preset shapes"


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
    values = (held.params, held.gradients, held.states, held.trainable, held.step_group)
    return dict(zip(HELD_COLUMNS, values))


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


def finish_row(row: dict[str, Any]) -> dict[str, Any]:
    """The comparison columns, every column present, in table order. The prediction is the row's own,
    made with it (trial_row); a row without one (a crashed driver's) gets one here."""
    for key, default in EARLIER_DEFAULTS.items():
        row.setdefault(key, default)
    if "predicted_peak_gib" not in row:
        row.update(prediction_fields(row))
    return _compared(row)


def repredicted(row: dict[str, Any], calibration: Optional[dict] = None) -> dict[str, Any]:
    """The row predicted again by this version (its traced figure as recorded, `calibration`'s
    activations), then finished: `report --predict`, and rows of versions that stored no terms."""
    for key, default in EARLIER_DEFAULTS.items():
        row.setdefault(key, default)
    row.update(prediction_fields(row, calibration))
    return _compared(row)


def _compared(row: dict[str, Any]) -> dict[str, Any]:
    peak, predicted = row.get("peak_allocated_gib_max"), row.get("predicted_peak_gib")
    # Only a finished trial reached its peak (an oom row holds the memory at the failure), and on CPU the
    # peak is the resident set (Python, torch and Ray included): no like-for-like ratio for those.
    row["measured_over_predicted"] = None
    if row.get("status") == "ok" and row.get("memory_kind") == "cuda" and peak and predicted:
        row["measured_over_predicted"] = peak / predicted
    row.update(band_fields(row))  # the measured device and ratio known now
    speed, predicted_speed = row.get("samples_per_s"), row.get("predicted_samples_per_s")
    row["measured_over_predicted_speed"] = (
        speed / predicted_speed if row.get("status") == "ok" and speed and predicted_speed else None
    )
    columns = results_columns()
    return {column: row.get(column) for column in columns} | {
        k: v for k, v in row.items() if k not in columns
    }


def skipped_row(spec, reason: str) -> dict[str, Any]:
    row = trial_row(spec)
    row.update(status="skipped", error=reason)
    return finish_row(row)
