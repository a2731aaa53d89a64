"""What a trial hands to Ray Train: each worker's entry point, the controller's callbacks that forward
every rank's report and each failed attempt to the trial, and the trainer that runs its controller in the
trial's own process, stops a worker group whose start failed, and ends its run without a 1 s wait.

No torch at import: Ray Train's controller unpickles this module, and Tune's trial driver imports it,
neither of which trains (bench/README.md, cut 7); the entry point imports torch on the worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from ray.train import UserCallback
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.util.queue import Queue

# Ray Train's own modules; a Ray without one keeps that part of its trainer as it is.
try:
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
except ImportError:
    PlacementGroupCleanerCallback = None
try:
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.worker_group import WorkerGroup
except ImportError:
    TrainController = WorkerGroup = None

from ray_zero.clock import process_started_at


def one_line_reason(error: BaseException) -> str:
    """The informative part of a (possibly wrapped, multi-line) worker error, on one line."""
    lines = [line.strip() for line in (str(error).strip() or type(error).__name__).splitlines()]
    lines = [line for line in lines if line and not line.startswith(
        ("Training failed due to worker errors", "Traceback", "[Rank"))]
    reason = lines[0] if lines else type(error).__name__
    died = next((line for line in lines if "worker process has died" in line or "killed" in line.lower()), None)
    if died and died != reason:
        reason = f"{reason} {died}"
    return reason[:400]


class AllRanksCallback(UserCallback):
    """Runs on the Train controller: puts every rank's report (a list in rank order, with the
    controller's process id) on the trial's queue."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint):
        self.queue.put(("report", {"ranks": list(metrics), "controller_pid": os.getpid()}))


class FailedAttemptsCallback(ControllerCallback):
    """Runs on the Train controller: puts each failed attempt of the worker group on the trial's queue,
    whether a worker failed while training or while the group was starting (a worker killed as it
    started: Ray Train's user callbacks hear only of the former)."""

    def __init__(self, queue: Queue):
        self.queue = queue

    def before_controller_execute_failure_decision(self, failure_decision) -> None:
        self.queue.put(("failure", failure_decision.value))  # retry, or raise after the last attempt


if PlacementGroupCleanerCallback is not None:
    class StopCleanerWithoutWaiting(PlacementGroupCleanerCallback):
        """Ray Train's placement-group cleaner (a detached actor that removes a run's placement group if
        the controller dies), told to stop at the end of the run without waiting for it to stop.

        Ray Train's own callback waits, and the cleaner's monitor thread notices only after its 1 s
        queue wait and a State API call: up to 1 s and more at the end of every trial, between the
        workers' shutdown and `fit()` returning (bench/README.md, cut 9). By then the run has removed
        its placement group; the cleaner exits on its own once the stop arrives, or finds the group
        gone if the controller is gone first."""

        def _stop_cleaner(self) -> None:
            if self._cleaner is not None:
                self._cleaner.stop.remote()
                self._cleaner = None
else:
    StopCleanerWithoutWaiting = None


if TrainController is not None:
    class WorkerGroupStoppedIfStartFails(WorkerGroup):
        """Ray Train's worker group, stopped (actors killed, placement group removed) when its start fails
        after its workers exist.

        Ray Train 2.60 cleans up a start that fails before then, but not one that fails in the backend's
        set-up or as the training function is launched, as when a worker is killed while it starts:
        `WorkerGroup.create` raises, the controller never holds the group and never stops it, and its
        placement group stays reserved while the controller's process lives. Here that process is Tune's
        trial driver, reused for the whole sweep, and the retry waited for the reserved CPUs or GPUs until
        the trial's start timeout (24 h): a sweep that never ended (tests/test_faults.py)."""

        def _start(self) -> None:
            try:
                super()._start()
            except Exception:
                if self.has_started():
                    self._worker_group_state.shutdown()
                    self._clear_state()
                raise

    class InProcessTrainController(TrainController):
        """Ray Train's controller, with a worker group that is stopped if its start fails."""

        worker_group_cls = WorkerGroupStoppedIfStartFails
else:
    InProcessTrainController = None


class Trainer(DataParallelTrainer):
    """Ray Train's DataParallelTrainer with its controller in the calling process (unless
    `controller_in_process` is false: Ray Train's own controller actor, as it is) and its placement-group
    cleaner stopped without waiting."""

    def __init__(self, *args, controller_in_process: bool = True, **kwargs):
        self.controller_in_process = controller_in_process
        super().__init__(*args, **kwargs)

    def _create_default_callbacks(self) -> list:
        callbacks = super()._create_default_callbacks()
        if StopCleanerWithoutWaiting is None:
            return callbacks
        return [StopCleanerWithoutWaiting() if type(c) is PlacementGroupCleanerCallback else c for c in callbacks]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        """Ray Train starts its controller as an actor: a new process, whose Python, Ray and Ray Train
        modules take over a second to load before it can create any worker (bench/README.md, cut 10).
        Here the same controller runs its control loop in this process, Tune's trial driver, which has
        them loaded already. The workers and the placement group it creates are owned by this process,
        as the actor was, and go with it. What differs: no TrainController in the Ray dashboard, and
        its log lines come from the trial driver."""
        if not self.controller_in_process or InProcessTrainController is None:
            return super()._initialize_and_run_controller(**controller_init_kwargs)
        controller = InProcessTrainController(**controller_init_kwargs)
        asyncio.run(controller.run())
        return controller.get_result()


def train_loop_per_worker(trial: dict[str, Any]) -> None:
    """Ray Train entry point: run `train` on this worker, publish live gauges, report once."""
    train_fn_started_at = time.time()  # Ray's worker set-up (actor, train context, process group) is done
    import ray
    import ray.train
    import ray.train.torch
    import torch
    from ray.util.metrics import Gauge

    from ray_zero.main_thread import HoldMainThread
    from ray_zero.worker import train

    process_started = process_started_at()
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device() if trial["use_gpu"] else torch.device("cpu")
    point = trial["point"]
    tags = {"trial": trial.get("trial_name", ""), "stage": str(point["stage"]),
            "micro_batch_size": str(point["micro_batch_size"]), "num_workers": str(point["num_workers"]),
            "rank": str(rank)}
    # Ray prefixes application metrics with "ray_": Prometheus and the dashboard show ray_zero_loss etc.
    gauges = {name: Gauge(f"zero_{name}", description=text, tag_keys=tuple(tags))
              for name, text in (("loss", "training loss of the latest step"),
                                 ("samples_per_s", "this rank's samples per second, recent steps"),
                                 ("peak_allocated_gib", "this rank's peak memory so far, GiB"),
                                 ("step", "optimizer steps done"))}

    def publish(step: int, values: dict[str, float]) -> None:
        gauges["step"].set(step, tags=tags)
        for name, value in values.items():
            gauges[name].set(value, tags=tags)

    hold = HoldMainThread() if trial["experiment"]["hold_main_thread"] else None
    with hold or contextlib.nullcontext():
        metrics = train(trial, rank, world_size, device, on_progress=publish)
    metrics.update(process_started_at=process_started, train_fn_started_at=train_fn_started_at,
                   pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(),
                   main_thread_held=bool(hold and hold.active))
    publish(metrics["steps"], {"loss": metrics["loss_last"], "samples_per_s": metrics["samples_per_s"],
                               "peak_allocated_gib": metrics["peak_allocated_gib"]})
    ray.train.report(metrics)
