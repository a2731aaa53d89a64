"""One grid point = one Tune trial, which drives one Ray Train TorchTrainer and reports one row.

Ray's own TuneReportCallback forwards rank 0's metrics only. `AllRanksCallback` forwards every
rank's report to a queue the trial owns; `run_trial` turns them (or the failure) into the row.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ray import tune
from ray.train import FailureConfig, RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchTrainer
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError
from ray.util.queue import Queue

from ray_zero.config import Experiment
from ray_zero.data import SAMPLE_BYTES, synthetic_count
from ray_zero.memory_model import predict_row
from ray_zero.model import PRESETS
from ray_zero.report import COLUMNS
from ray_zero.worker import TrialOutOfMemory, train_loop_per_worker

# Per-rank measurements aggregated as max and min over ranks (memory is never rank 0's alone).
_MAX_MIN = {
    "peak_allocated_gib": "peak_allocated_gib", "peak_reserved_gib": "peak_reserved_gib",
    "timed_peak_allocated_gib": "timed_peak_allocated_gib", "nvml_used_gib": "nvml_used_gib",
    "optimizer_state_bytes": "optimizer_state_bytes_per_rank", "parameter_bytes": "parameter_bytes_per_rank",
    "gradient_bytes": "gradient_bytes_per_rank", "master_param_bytes": "master_param_bytes_per_rank",
    "other_optimizer_bytes": "other_optimizer_bytes_per_rank", "data_bytes": "data_bytes_per_rank",
}
GIB = 1024 ** 3


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
    # On CPU the peak is the resident set (Python, torch, Ray included): no like-for-like ratio.
    if row["memory_kind"] == "cuda" and peak and predicted:
        row["measured_over_predicted"] = peak / predicted
    return {column: row.get(column) for column in COLUMNS} | {
        k: v for k, v in row.items() if k not in COLUMNS}


def _reason(error: BaseException) -> str:
    """The informative part of a (possibly wrapped, multi-line) worker error, on one line."""
    lines = [line.strip() for line in (str(error).strip() or type(error).__name__).splitlines()]
    lines = [line for line in lines if line and not line.startswith(
        ("Training failed due to worker errors", "Traceback", "[Rank"))]
    reason = lines[0] if lines else type(error).__name__
    died = next((line for line in lines if "worker process has died" in line or "killed" in line.lower()), None)
    if died and died != reason:
        reason = f"{reason} {died}"
    return reason[:400]


def _out_of_memory(error: BaseException) -> dict | None:
    """The memory at failure if `error` is (or wraps) an out-of-memory error, else None."""
    for candidate in (error, getattr(error, "cause", None), getattr(error, "__cause__", None)):
        if isinstance(candidate, TrialOutOfMemory):
            return candidate.memory
    return {} if "out of memory" in str(error).lower() else None


def failure_fields(error: BaseException) -> dict[str, Any]:
    """status, error and (for out-of-memory) the memory at the failure, from a failed fit()."""
    failures = getattr(error, "worker_failures", None) if isinstance(error, WorkerGroupError) else None
    failures = failures or {None: error}
    for rank, worker_error in sorted(failures.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        memory = _out_of_memory(worker_error)
        if memory is not None:
            row = {"status": "oom", "error": _reason(worker_error)}
            if memory:
                row.update(peak_allocated_gib_max=memory.get("peak_allocated_gib"),
                           peak_reserved_gib_max=memory.get("peak_reserved_gib"))
            return row
    rank, worker_error = next(iter(failures.items()))
    where = f"rank {rank}: " if rank is not None else ""
    return {"status": "failed", "error": where + _reason(worker_error)}


class AllRanksCallback(UserCallback):
    """Runs on the Train controller: puts every rank's report (a list in rank order), and each failed
    attempt of the worker group, on the trial's queue."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint):
        self.queue.put(("report", list(metrics)))

    def after_exception(self, run_context, worker_exceptions):
        self.queue.put(("failure", {rank: _reason(error) for rank, error in worker_exceptions.items()}))


def join_storage(storage: str, name: str) -> str:
    return f"{storage.rstrip('/')}/{name}" if "://" in storage else str(Path(storage) / name)


def run_trial(config: dict[str, Any]) -> None:
    """Tune function trainable: run one grid point as a TorchTrainer and report its row to Tune."""
    driver_started_at = time.time()
    # The Train controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default), so
    # a finished trial waited up to 2 s to be noticed: 0.25 s saved about 3 s a trial (bench/README.md).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    experiment = Experiment.model_validate(config["experiment"])
    point, precision, use_gpu = config["point"], config["precision"], config["use_gpu"]
    context = tune.get_context()
    row = base_row(experiment, point, precision, use_gpu)
    row["driver_started_at"] = driver_started_at
    trial = {"experiment": config["experiment"], "point": point, "precision": precision,
             "use_gpu": use_gpu, "trial_name": context.get_trial_name()}
    if experiment.fault is not None:
        # Fault injection counts attempts with marker files (a testing aid for one machine).
        trial["attempt_dir"] = str(Path(tempfile.gettempdir()) / "ray_zero_attempts" / context.get_trial_id())

    queue = Queue(actor_options={"num_cpus": 0})
    resources = {"CPU": experiment.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=trial,
        scaling_config=ScalingConfig(num_workers=point["num_workers"], use_gpu=use_gpu,
                                     resources_per_worker=resources,
                                     placement_strategy=experiment.placement_strategy),
        run_config=RunConfig(name=context.get_trial_id(), storage_path=join_storage(config["storage_path"], "train"),
                             failure_config=FailureConfig(max_failures=experiment.max_failures),
                             callbacks=[AllRanksCallback(queue)]),
    )
    row["fit_started_at"] = time.time()
    try:
        trainer.fit()
        row["status"] = "ok"
    except TrainingFailedError as error:
        row.update(failure_fields(error))
    row["fit_finished_at"] = time.time()
    row["wall_s"] = row["fit_finished_at"] - row["fit_started_at"]
    reports, failed_attempts = [], 0
    while not queue.empty():
        kind, item = queue.get_nowait()
        if kind == "report":
            reports = item  # the last report holds each rank's final measurements
        else:
            failed_attempts += 1
    if reports:
        row.update(aggregate_ranks(reports))
        row["per_rank"] = [{"trial": row["trial"], **r} for r in reports]
    elif row["status"] == "ok":
        row.update(status="failed", error="no worker reported metrics")
    # Ray Train retried the worker group after each failure, up to max_failures.
    row["attempts"] = failed_attempts + (1 if row["status"] == "ok" else 0)
    queue.shutdown()
    tune.report(finish_row(row))
