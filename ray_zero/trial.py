"""One grid point = one Tune trial, which drives one Ray Train run (torch, data parallel) and reports one row.

Ray's own TuneReportCallback forwards rank 0's metrics only. `AllRanksCallback` (ray_zero.train_run)
forwards every rank's report to a queue the trial owns; `run_trial` turns them (or the failure) into
the row. This process trains nothing and imports no torch (bench/README.md, cut 7).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ray import tune
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.exceptions import TrainingFailedError, WorkerGroupError
from ray.util.queue import Queue

from ray_zero.clock import process_started_at
from ray_zero.config import Experiment
from ray_zero.report import join_storage
from ray_zero.rows import aggregate_ranks, base_row, finish_row
from ray_zero.torch_backend import ImportTorchBackendEarly, LazyTorchConfig
from ray_zero.train_run import (AllRanksCallback, FailedAttemptsCallback, Trainer, one_line_reason,
                                train_loop_per_worker)


def _out_of_memory(error: BaseException) -> dict | None:
    """The memory at failure if `error` is (or wraps) an out-of-memory error, else None."""
    from ray_zero.worker import TrialOutOfMemory  # torch: only a failed trial pays for the import

    for candidate in (error, getattr(error, "cause", None), getattr(error, "__cause__", None)):
        if isinstance(candidate, TrialOutOfMemory):
            return candidate.memory
    return {} if "out of memory" in str(error).lower() else None


def failure_fields(error: BaseException) -> dict[str, Any]:
    """status, error and (for out-of-memory) the memory at the failure, from a failed fit()."""
    failures = getattr(error, "worker_failures", None) if isinstance(error, WorkerGroupError) else None
    failures = failures or {None: error}
    for worker_error in failures.values():  # any rank out of memory makes the trial an oom row
        memory = _out_of_memory(worker_error)
        if memory is not None:
            row = {"status": "oom", "error": one_line_reason(worker_error)}
            if memory:
                row.update(peak_allocated_gib_max=memory.get("peak_allocated_gib"),
                           peak_reserved_gib_max=memory.get("peak_reserved_gib"))
            return row
    rank, worker_error = next(iter(failures.items()))
    where = f"rank {rank}: " if rank is not None else ""
    return {"status": "failed", "error": where + one_line_reason(worker_error)}


def run_trial(config: dict[str, Any]) -> None:
    """Tune function trainable: run one grid point as a TorchTrainer and report its row to Tune."""
    driver_started_at = time.time()
    # The Train controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default), so
    # a finished trial waited up to 2 s to be noticed: 0.25 s saved about 3 s a trial (bench/README.md).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    # A trial started early (overlap_startup) waits for the running trial's GPUs: Train's 60 s limit on
    # that wait would end in a retry, with a warning, every minute of a long trial.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(24 * 3600))
    # Ray Train moves each worker into a new folder per run. The kernels cuDNN compiles at run time (NVRTC)
    # are reused by a later process only from the same working directory, so every trial's first step
    # compiled them again: about 1 s on the H200 (bench/README.md, cut 8). Workers stay where Ray started
    # them; ray_zero's paths are absolute.
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    experiment = Experiment.model_validate(config["experiment"])
    point, precision, use_gpu = config["point"], config["precision"], config["use_gpu"]
    context = tune.get_context()
    row = base_row(experiment, point, precision, use_gpu)
    # Tune reuses this process for the next trial (reuse_actors): its start-up is paid once per sweep.
    row.update(driver_started_at=driver_started_at, driver_pid=os.getpid(),
               driver_process_started_at=process_started_at())
    trial = {"experiment": config["experiment"], "point": point, "precision": precision,
             "use_gpu": use_gpu, "trial_name": context.get_trial_name()}
    if experiment.fault is not None:
        # Fault injection counts attempts with marker files (a testing aid for one machine).
        trial["attempt_dir"] = str(Path(tempfile.gettempdir()) / "ray_zero_attempts" / context.get_trial_id())

    queue = Queue(actor_options={"num_cpus": 0})
    resources = {"CPU": experiment.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    # TorchTrainer with a TorchConfig that imports torch only on the controller and the workers.
    trainer = Trainer(
        train_loop_per_worker,
        controller_in_process=experiment.controller_in_trial_driver,
        train_loop_config=trial,
        backend_config=LazyTorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=point["num_workers"], use_gpu=use_gpu,
                                     resources_per_worker=resources,
                                     placement_strategy=experiment.placement_strategy),
        run_config=RunConfig(name=context.get_trial_id(), storage_path=join_storage(config["storage_path"], "train"),
                             # A worker that dies while the group starts is a failure of the controller to
                             # Ray Train, retried without limit by default: here as often as a failed worker.
                             failure_config=FailureConfig(max_failures=experiment.max_failures,
                                                          controller_failure_limit=experiment.max_failures),
                             callbacks=[AllRanksCallback(queue), FailedAttemptsCallback(queue),
                                        ImportTorchBackendEarly()],
                             # Read by each worker's Ray core as it starts (Ray's job supervisor does the same).
                             worker_runtime_env={"env_vars": {"RAY_worker_niceness": str(experiment.worker_niceness)}}),
    )
    row["fit_started_at"] = time.time()
    try:
        trainer.fit()
        row["status"] = "ok"
    except TrainingFailedError as error:
        row.update(failure_fields(error))
    row["fit_finished_at"] = time.time()
    reports, failed_attempts = [], 0
    while not queue.empty():
        kind, item = queue.get_nowait()
        if kind == "report":
            reports = item["ranks"]  # the last report holds each rank's final measurements
            row["controller_pid"] = item["controller_pid"]
        else:
            failed_attempts += 1
    # The trial's own time runs from the first worker process of the attempt that reported; before
    # that, Ray Train's controller started (and, for a trial started early, waited for free GPUs).
    first_worker = min((r["process_started_at"] for r in reports if "process_started_at" in r), default=None)
    row["queued_s"] = first_worker - row["fit_started_at"] if first_worker else None
    row["wall_s"] = row["fit_finished_at"] - (first_worker or row["fit_started_at"])
    if reports:
        row.update(aggregate_ranks(reports))
        row["per_rank"] = [{"trial": row["trial"], **r} for r in reports]
    elif row["status"] == "ok":
        row.update(status="failed", error="no worker reported metrics")
    # Ray Train retried the worker group after each failure, up to max_failures.
    row["attempts"] = failed_attempts + (1 if row["status"] == "ok" else 0)
    queue.shutdown()
    tune.report(finish_row(row))
