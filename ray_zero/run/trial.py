"""One grid point = one Tune trial, which runs one `ray.train.torch.TorchTrainer` and reports one row.

Three layers, as in Ray Train V2's documented pattern: `train_loop` runs on every worker (a rank);
`run_trial` is the Tune function trainable that builds the TorchTrainer and calls `fit()` (the driver);
the Tuner is in ray_zero/run/session.py. Ray's own TuneReportCallback forwards rank 0's metrics only: the
public `UserCallback.after_report` receives every rank's, and puts them on the sweep's trial log
(ray_zero/run/trial_log.py), which also counts each rank's attempts and follows its phases: past its bound
(ray_zero/run/watchdog.py) a trial is stopped. Public Ray API only.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import ray
from ray import tune
from ray.train import (
    ControllerError,
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
from ray_zero.measure import correction
from ray_zero.rows import aggregate_ranks, failed_row_fields, finish_row, trial_row
from ray_zero.run.gpu_sharing import corrected_share
from ray_zero.run.watchdog import (
    keep_stacks_on_signal,
    lost_nodes,
    timeout_fields,
    trial_bound_s,
    unplaceable,
    watch,
    worker_runtime_env,
)
from ray_zero.schema import rank_report
from ray_zero.store import join_storage


def trial_config(spec: TrialSpec) -> dict[str, Any]:
    """A trial's entry in Tune's config: the spec, and its name as a string Tune can show."""
    return {"spec": spec, "name": spec.name}


class AllRanksCallback(UserCallback):
    """Runs on the Train controller: every rank's report, in rank order, to the trial log."""

    def __init__(self, log, trial: str):
        self.log, self.trial = log, trial

    def after_report(self, run_context, metrics, checkpoint):
        ray.get(self.log.reported.remote(self.trial, list(metrics)))


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train entry point on every worker: run `train` as this rank, publish live gauges, report once."""
    # Imported here, in the worker: Ray Train's controller unpickles this function, and torch imported at
    # this module's top would cost it seconds at every trial (bench/startup_profile.md, cut 7).
    import ray.train
    import ray.train.torch
    import torch
    from ray.util.metrics import Gauge

    from ray_zero.train.worker import train

    spec: TrialSpec = config["spec"]
    log, key = config["log"], config["log_key"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    attempt = ray.get(log.started.remote(key, rank, node, os.getpid()))
    if ray.get(log.stopped.remote(key)):  # a retry of a trial stopped past its bound: nothing to do
        raise RuntimeError("the trial was stopped past its bound (runtime.trial_timeout_s)")
    stacks = keep_stacks_on_signal(key, rank)  # noqa: F841  open while the rank lives
    diagnostics = None
    if spec.diagnostics:
        from ray_zero.measure.diagnostics import Diagnostics

        diagnostics = Diagnostics()
        diagnostics.figures["node_id"] = ray.get_runtime_context().get_node_id()
    device = ray.train.torch.get_device() if spec.use_gpu else torch.device("cpu")
    point = {k: str(v) for k, v in spec.point.fields().items() if v is not None}  # seq_len: on an axis
    tags = {"trial": spec.name, **point, "rank": str(rank)}
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

    def phase(name: str) -> None:  # not waited for: a handful a trial, and at most one a second
        log.phase.remote(key, rank, name)

    metrics = train(
        spec,
        rank,
        world_size,
        device,
        attempt=attempt,
        on_progress=publish,
        on_phase=phase,
        diagnostics=diagnostics,
    )
    metrics["node_id"] = node
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
    if isinstance(error, ControllerError):  # Ray Train's own failure, not a rank's: its cause, named
        cause, name = error.controller_failure, type(error.controller_failure).__name__
        fields = failed_row_fields({None: cause})
        reason = "" if fields["error"] == name else f": {fields['error']}"
        return {**fields, "error": f"Ray Train's controller failed: {name}{reason}"}
    failures = getattr(error, "worker_failures", None) if isinstance(error, WorkerGroupError) else None
    return failed_row_fields(failures or {None: error})


def ray_train_settings(private_ray: bool) -> dict[str, str]:
    """What Ray Train reads from its driver's environment (a trial's driver; `private_ray`: a Ray that
    ray_zero started on this machine). Ray Train passes them on to its controller and workers."""
    settings = {
        # The controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default): a
        # finished trial waited up to 2 s to be noticed.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
        # A trial started early (overlap_startup) waits for the running trial's GPUs: Train's 60 s limit
        # on that wait would end in a retry, with a warning, every minute of a long trial. Once the
        # workers exist, the trial's own bound covers their start (ray_zero/run/watchdog.py).
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(24 * 3600),
        # Ray Train moves each worker into a new folder per run; the kernels cuDNN compiles at run time
        # are reused by a later process only from the same working directory (about 1 s a trial, H200).
        "RAY_CHDIR_TO_TRIAL_DIR": "0",
    }
    if private_ray:
        # Ray Train watches every run's nodes for preemption from an actor of its own: a process more per
        # trial, for nodes that cannot be preempted on a private Ray.
        settings["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    return settings


def train_environment(private_ray: bool) -> bool:
    """Ray Train's settings (`ray_train_settings`, the user's own values kept) in this process's
    environment, where it is a trial's driver: an actor of the sweep's, the process that builds the
    TorchTrainer, never the caller's process (where it does nothing: False)."""
    if ray.get_runtime_context().get_actor_id() is None:
        return False
    for name, value in ray_train_settings(private_ray).items():
        os.environ.setdefault(name, value)
    return True


def torch_trainer(
    loop,
    loop_config: dict[str, Any],
    spec: TrialSpec,
    name: str,
    log,
    log_key: str,
    max_failures: int,
    log_name: str | None = None,
) -> TorchTrainer:
    """The TorchTrainer of one run: the point's workers, every rank's reports to the trial log (`log`, the
    actor named `log_name`: with it, each worker process is in the log from its start)."""
    experiment, point = spec.experiment, spec.point
    # A share of a GPU under 1: the trial starts beside others on one GPU (ray_zero/run/gpu_sharing.py).
    gpus = {"GPU": spec.gpu_share} if spec.use_gpu else {}
    resources = {"CPU": experiment.runtime.cpus_per_worker, **gpus}
    bound = trial_bound_s(spec)
    return TorchTrainer(
        loop,
        train_loop_config=loop_config,
        # The process group gives up on a collective at the trial's bound too (Ray Train's default: 30 min).
        torch_config=TorchConfig(
            backend="nccl" if spec.use_gpu else "gloo", **({"timeout_s": int(bound) + 60} if bound else {})
        ),
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
            worker_runtime_env=worker_runtime_env(log_name, log_key) if log_name else None,
        ),  # its per-report lines stay in the logs
    )


def run_trial(config: dict[str, Any]) -> None:
    """Tune function trainable: run one grid point as a TorchTrainer and report its row to Tune. A trial
    that runs out of memory on a GPU it shares with other trials runs again alone before its row says
    so: the other trials' memory, not its own, may have been the cause."""
    spec: TrialSpec = config["trial"]["spec"]
    train_environment(spec.private_ray)
    context = tune.get_context()
    trial_key = spec.name + context.get_trial_id()  # the trial log's key: built here only, passed on
    log = ray.get_actor(config["log_name"])
    spec, row = planned(spec, ray.get(log.corrections.remote()))
    bound = trial_bound_s(spec)
    fit_started_at = time.time()
    impossible = unplaceable(spec)
    for alone in () if impossible else (False, True):
        run_spec = dataclasses.replace(spec, gpu_share=1.0) if alone else spec
        trainer = torch_trainer(
            train_loop,
            {"spec": run_spec, "log": log, "log_key": trial_key},
            run_spec,
            context.get_trial_id() + ("-alone" if alone else ""),
            log,
            trial_key,
            spec.experiment.runtime.max_failures,
            config["log_name"],
        )
        outcome: dict[str, Any] = {}
        fit = threading.Thread(target=_fit, args=(trainer, outcome), name=spec.name, daemon=True)
        fit.start()
        timed_out = watch(fit, log, trial_key, bound)
        if timed_out is not None:
            row.update(timeout_fields(timed_out, bound))
            break
        if "error" in outcome:
            row.update(failure_fields(outcome["error"]))
            lost = lost_nodes(ray.get(log.progress.remote(trial_key)))
            if lost:  # the row names the node the trial lost
                row["error"] = f"node {', '.join(lost)} was lost; {row['error']}"
        else:
            row.update(status="ok", error=None)
        if row["status"] != "oom" or run_spec.gpu_share >= 1.0:
            break
        row["oom_while_sharing"] = row["error"]  # and the trial runs again, alone
    if impossible:
        row.update(status="failed", error=impossible)
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
    missed = correction.from_row(finish_row(dict(row)))
    if missed is not None:  # the later trials of its engine are planned with what it measured
        log.missed.remote(missed)
    tune.report(_for_tune(row))


def planned(spec: TrialSpec, corrections: correction.Corrections) -> tuple[TrialSpec, dict[str, Any]]:
    """The trial as planned once the trials before it have run, and its row (trial_row): where one of its
    engine measured a peak above its band (ray_zero/measure/correction.py), the row says so and, on a
    shared GPU, its share is made again from the corrected need."""
    row = trial_row(spec)
    found = corrections.for_row(row)
    row.update(correction.corrected_fields(row, found))
    if "corrected_from" not in row or spec.gpu_room is None or spec.gpu_share >= 1.0:
        return spec, row
    saved = getattr(spec.model, "saved_bytes_per_sample", None)
    share = corrected_share(
        row, spec.gpu_room, spec.gpu_share, found, spec.calibration, saved, spec.point.num_workers
    )
    row["gpu_share"] = share  # the rest of the row does not depend on the share
    return dataclasses.replace(spec, gpu_share=share), row


def _fit(trainer: TorchTrainer, outcome: dict[str, Any]) -> None:
    """The run, in a thread beside its watchdog; how it failed, if it did, in `outcome`."""
    try:
        trainer.fit()
    except TrainingFailedError as error:
        outcome["error"] = error


def _for_tune(row: dict[str, Any]) -> dict[str, Any]:
    """Tune's results hold flat values: the per-rank lists travel as one JSON string."""
    import json

    nested = {k: row.pop(k) for k in ("per_rank", "diagnostics", "loss_by_epoch", "stacks") if k in row}
    return {**row, "nested_json": json.dumps(nested, default=str)}
