"""One grid point = one Tune trial, which runs one `ray.train.torch.TorchTrainer` and reports one row.

Three layers, as in Ray Train V2's documented pattern: `train_loop` runs on every worker (a rank);
`run_trial` is the Tune function trainable that builds the TorchTrainer and calls `fit()` (the driver);
the Tuner is in ray_zero/run/session.py. Ray's own TuneReportCallback forwards rank 0's metrics only: the
public `UserCallback.after_report` receives every rank's, and puts them on the sweep's `TrialLog` actor,
which also counts each rank's attempts. Public Ray API only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import defaultdict
from typing import Any, Optional

import ray
from ray import tune
from ray.train import (
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    UserCallback,
    WorkerGroupError,
)
from ray.train.torch import TorchConfig, TorchTrainer

from ray_zero.config import TrialSpec
from ray_zero.rows import aggregate_ranks, failed_row_fields, trial_row
from ray_zero.schema import rank_report
from ray_zero.store import join_storage


@ray.remote(num_cpus=0)
class TrialLog:
    """The sweep's record of what its trials' ranks said, by trial: how often each rank started (its
    attempt number) and the last report of all ranks. One actor for the whole sweep, looked up by name."""

    def __init__(self):
        self._starts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._reports: dict[str, list[list[dict]]] = defaultdict(list)

    def started(self, trial: str, rank: int) -> int:
        self._starts[trial][rank] += 1
        return self._starts[trial][rank]

    def reported(self, trial: str, ranks: list[dict]) -> None:
        self._reports[trial].append(ranks)

    def take(self, trial: str) -> tuple[Optional[list[dict]], int]:
        """The last all-rank report and the number of attempts that started, forgotten after."""
        starts = self._starts.pop(trial, {})
        reports = self._reports.pop(trial, [])
        return (reports[-1] if reports else None), max(starts.values(), default=0)

    def take_reports(self, trial: str) -> list[list[dict]]:
        """Every all-rank report since the last call (a search reports once per probe), forgotten after."""
        return self._reports.pop(trial, [])


def trial_config(spec: TrialSpec) -> dict[str, Any]:
    """A trial's entry in Tune's config: the spec, and its name as a string Tune can show."""
    return {"spec": spec, "name": spec.name}


def trial_log(name: str):
    return TrialLog.options(name=name, get_if_exists=True, lifetime=None).remote()


class AllRanksCallback(UserCallback):
    """Runs on the Train controller: every rank's report, in rank order, to the trial log."""

    def __init__(self, log, trial: str):
        self.log, self.trial = log, trial

    def after_report(self, run_context, metrics, checkpoint):
        ray.get(self.log.reported.remote(self.trial, list(metrics)))


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train entry point on every worker: run `train` as this rank, publish live gauges, report once."""
    # Imported here, in the worker: Ray Train's controller unpickles this function, and torch imported at
    # this module's top would cost it seconds at every trial (bench/README.md, "torch not in the controller").
    import ray.train
    import ray.train.torch
    import torch
    from ray.util.metrics import Gauge

    from ray_zero.train.worker import train

    spec: TrialSpec = config["spec"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    attempt = ray.get(config["log"].started.remote(config["log_key"], rank))
    diagnostics = None
    if spec.diagnostics:
        from ray_zero.measure.diagnostics import Diagnostics

        diagnostics = Diagnostics()
        diagnostics.figures["node_id"] = ray.get_runtime_context().get_node_id()
    device = ray.train.torch.get_device() if spec.use_gpu else torch.device("cpu")
    tags = {"trial": spec.name, **{k: str(v) for k, v in spec.point.fields().items()}, "rank": str(rank)}
    # Ray prefixes application metrics with "ray_": the dashboard and Prometheus show ray_zero_loss etc.
    gauges = {
        name: Gauge(f"zero_{name}", description=text, tag_keys=tuple(tags))
        for name, text in (
            ("loss", "training loss of the latest step"),
            ("samples_per_s", "this rank's samples per second, recent steps"),
            ("peak_allocated_gib", "this rank's peak memory so far, GiB"),
            ("step", "optimizer steps done"),
        )
    }

    def publish(step: int, values: dict[str, float]) -> None:
        gauges["step"].set(step, tags=tags)
        for name, value in values.items():
            if value is not None:
                gauges[name].set(value, tags=tags)

    metrics = train(
        spec, rank, world_size, device, attempt=attempt, on_progress=publish, diagnostics=diagnostics
    )
    metrics["node_id"] = ray.get_runtime_context().get_node_id()
    metrics["pid"] = os.getpid()  # the rank's process, as the Ray dashboard lists it
    if diagnostics:
        metrics["diagnostics"] = diagnostics.result()
    publish(
        metrics["steps"],
        {
            "loss": metrics["loss_last"],
            "samples_per_s": metrics["samples_per_s"],
            "peak_allocated_gib": metrics["peak_allocated_gib"],
        },
    )
    ray.train.report(rank_report(metrics))


def failure_fields(error: BaseException) -> dict[str, Any]:
    """status, error and (for out-of-memory) the memory at the failure, from a failed fit()."""
    failures = getattr(error, "worker_failures", None) if isinstance(error, WorkerGroupError) else None
    return failed_row_fields(failures or {None: error})


def train_environment(spec: TrialSpec) -> None:
    """Settings Ray Train reads from the driver's environment, before its first TorchTrainer."""
    # Read by Ray Train in this process and passed on to its controller. The controller polls its workers
    # every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default): a finished trial waited up to 2 s to be
    # noticed.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    # A trial started early (overlap_startup) waits for the running trial's GPUs: Train's 60 s limit on that
    # wait would end in a retry, with a warning, every minute of a long trial.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(24 * 3600))
    # Ray Train moves each worker into a new folder per run; the kernels cuDNN compiles at run time are
    # reused by a later process only from the same working directory (about 1 s a trial on the H200).
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    if spec.private_ray:
        # Ray Train watches every run's nodes for preemption from an actor of its own: a process more per
        # trial, for nodes that cannot be preempted on a private Ray.
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")


def torch_trainer(
    loop, loop_config: dict[str, Any], spec: TrialSpec, name: str, log, log_key: str, max_failures: int
) -> TorchTrainer:
    """The TorchTrainer of one run: the point's workers, every rank's reports to the trial log."""
    experiment, point = spec.experiment, spec.point
    # A share of a GPU under 1: the trial starts beside others on one GPU (ray_zero/run/gpu_sharing.py).
    gpus = {"GPU": spec.gpu_share} if spec.use_gpu else {}
    resources = {"CPU": experiment.runtime.cpus_per_worker, **gpus}
    return TorchTrainer(
        loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if spec.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=point.num_workers,
            use_gpu=spec.use_gpu,
            resources_per_worker=resources,
            placement_strategy=experiment.runtime.placement_strategy,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=join_storage(spec.storage_path, "train"),
            # A worker that dies while the group starts is a controller failure to Ray Train, retried
            # without limit by default: here as often as a worker that fails while training.
            failure_config=FailureConfig(max_failures=max_failures, controller_failure_limit=max_failures),
            callbacks=[AllRanksCallback(log, log_key)],
            logging_config=LoggingConfig(log_level="WARNING"),
        ),  # its per-report lines stay in the logs
    )


def run_trial(config: dict[str, Any]) -> None:
    """Tune function trainable: run one grid point as a TorchTrainer and report its row to Tune. A trial
    that runs out of memory on a GPU it shares with other trials runs again alone before its row says
    so: the other trials' memory, not its own, may have been the cause."""
    spec: TrialSpec = config["trial"]["spec"]
    train_environment(spec)
    context = tune.get_context()
    trial_key = spec.name + context.get_trial_id()  # the trial log's key: built here only, passed on
    log = ray.get_actor(config["log_name"])
    row = trial_row(spec)
    fit_started_at = time.time()
    for alone in (False, True):
        run_spec = dataclasses.replace(spec, gpu_share=1.0) if alone else spec
        trainer = torch_trainer(
            train_loop,
            {"spec": run_spec, "log": log, "log_key": trial_key},
            run_spec,
            context.get_trial_id() + ("-alone" if alone else ""),
            log,
            trial_key,
            spec.experiment.runtime.max_failures,
        )
        try:
            trainer.fit()
            row.update(status="ok", error=None)
        except TrainingFailedError as error:
            row.update(failure_fields(error))
        if row["status"] != "oom" or run_spec.gpu_share >= 1.0:
            break
        row["oom_while_sharing"] = row["error"]  # and the trial runs again, alone
    fit_finished_at = time.time()
    reports, attempts = ray.get(log.take.remote(trial_key))
    row["attempts"] = attempts
    row["wall_s"] = fit_finished_at - fit_started_at
    # When the trial's run began and ended (trials.jsonl): a trial started early began before the one it
    # waited for had ended.
    row["fit_started_at"], row["fit_finished_at"] = fit_started_at, fit_finished_at
    if reports:
        row.update(aggregate_ranks(reports))
        row["per_rank"] = [
            {"trial": spec.name, **{k: v for k, v in r.items() if k != "diagnostics"}} for r in reports
        ]
        if spec.diagnostics:
            row["diagnostics"] = [
                {
                    "trial": spec.name,
                    "rank": r["rank"],
                    "fit_started_at": fit_started_at,
                    "fit_finished_at": fit_finished_at,
                    "driver_pid": os.getpid(),
                    **r.get("diagnostics", {}),
                }
                for r in reports
            ]
    elif row["status"] == "ok":
        row.update(status="failed", error="no worker reported metrics")
    tune.report(_for_tune(row))


def _for_tune(row: dict[str, Any]) -> dict[str, Any]:
    """Tune's results hold flat values: the per-rank lists travel as one JSON string."""
    import json

    nested = {k: row.pop(k) for k in ("per_rank", "diagnostics", "loss_by_epoch") if k in row}
    return {**row, "nested_json": json.dumps(nested, default=str)}
