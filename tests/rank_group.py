"""The rank-level harness: what a Ray Train worker runs, without Ray.

A `RankGroup` is `world_size` spawned processes under torch.distributed (gloo), set up as Ray Train sets
up its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, one process group, one thread per rank).
They stay up between calls, so a test session pays for the processes and their imports (torch,
DeepSpeed, Transformers) once per group size, not once per spec: `call(fn, ...)` runs `fn(rank,
world_size, ...)` on every rank; `train(spec)` runs `ray_zero.train.worker.train` (the function a
`TorchTrainer` worker runs) and `row(spec)` turns all ranks' results into the results row with the same
code as the Ray path (ray_zero/rows.py).

A rank that raises is reported with its exception; a group of several ranks is then stopped (its other
ranks may be waiting in a collective that never completes) and started again by the next call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable

from ray_zero.config import Experiment, Point, TrialSpec
from ray_zero.experiment_file import load_experiment
from ray_zero.models.describe import ModelInfo, describe_lengths
from ray_zero.rows import aggregate_ranks, failed_row_fields, finish_row, skipped_row, trial_row
from ray_zero.run.plan import Cluster, plan_sweep

READY_TIMEOUT_S = 180
"""Starting a rank: spawn, imports, the process group."""
GRACE_S = 10
"""After one rank failed, how long the others may take to return before the group is stopped."""


LAPTOP = Cluster(gpus=0, cpus=2, source="this 2-CPU test machine")
_DESCRIBED: dict[str, ModelInfo] = {}


def experiment_of(path: str | os.PathLike, *overrides: str) -> Experiment:
    """An experiment file with --set overrides, its paths absolute (as a sweep makes them)."""
    return load_experiment(path, list(overrides)).with_absolute_paths()


def describe(experiment: Experiment) -> ModelInfo:
    """The driver's description of the experiment's model (meta device), once per model."""
    key = repr((experiment.model_source(), experiment.grid.seq_len))
    if key not in _DESCRIBED:
        _DESCRIBED[key] = describe_lengths(experiment.model_source(), experiment.grid.seq_len)
    return _DESCRIBED[key]


def trial_specs(experiment: Experiment, cluster: Cluster = LAPTOP) -> dict[str, TrialSpec]:
    """Every runnable point's TrialSpec, by trial name, as a sweep on `cluster` would make them."""
    plan = plan_sweep(experiment, cluster)
    model = describe(experiment)
    return {
        p.name: TrialSpec(experiment, p, plan.precision, plan.use_gpu, model, storage_path="unused")
        for p in plan.runnable
    }


def skipped_rows(experiment: Experiment, cluster: Cluster = LAPTOP) -> list[dict[str, Any]]:
    """The rows a sweep records for the points it does not run, with their reasons."""
    plan = plan_sweep(experiment, cluster)
    model = describe(experiment)
    return [
        skipped_row(TrialSpec(experiment, p, plan.precision, plan.use_gpu, model, "unused"), reason)
        for p, reason in plan.skipped
    ]


def trial_spec(experiment: Experiment, point: Point) -> TrialSpec:
    """One point's TrialSpec (a point of the grid or not), CPU, the experiment's precision."""
    return TrialSpec(
        experiment, point, experiment.resolved_precision(False), False, describe(experiment), "unused"
    )


class RankFailed(Exception):
    """One or more ranks raised: `errors` by rank (the exceptions as the ranks raised them)."""

    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]):
        super().__init__("; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in errors.items()))
        self.errors, self.tracebacks = errors, tracebacks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _portable(error: BaseException) -> BaseException:
    """The exception itself if it survives pickling (ray_zero's TrialOutOfMemory does), else its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _rank_main(rank: int, world_size: int, port: int, connection) -> None:
    import torch
    import torch.distributed as dist

    from ray_zero.train.worker import jit_ops_dir

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        TORCH_EXTENSIONS_DIR=jit_ops_dir(),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # as a Ray Train worker with one CPU: the ranks share the machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    connection.send(("ready", None))
    while True:
        job = connection.recv()
        if job is None:
            break
        fn, args, kwargs, cwd = job
        try:
            os.chdir(cwd)  # where the caller is, as Ray Train workers start in the driver's working directory
            connection.send(("ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException as error:  # the test sees it as the rank raised it
            connection.send(("error", (_portable(error), traceback.format_exc())))
    dist.destroy_process_group()


def train_rank(rank: int, world_size: int, spec: TrialSpec, **kwargs) -> dict[str, Any]:
    """A TorchTrainer worker's work on this rank (ray_zero.run.trial.train_loop calls the same `train`)."""
    import torch

    from ray_zero.train.worker import train

    return train(spec, rank, world_size, torch.device("cpu"), **kwargs)


class RankGroup:
    """`world_size` ranks under torch.distributed (gloo), started on first use, kept between calls."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._processes: list = []
        self._connections: list = []
        self.starts = 0
        """How often the group was started (once, unless a rank failed)."""

    def _start(self) -> None:
        context = mp.get_context("spawn")
        port = _free_port()
        self._processes, self._connections = [], []
        for rank in range(self.world_size):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_rank_main, args=(rank, self.world_size, port, theirs), daemon=True
            )
            process.start()
            self._processes.append(process)
            self._connections.append(mine)
        for rank, connection in enumerate(self._connections):
            if not connection.poll(READY_TIMEOUT_S):
                self.stop()
                raise RuntimeError(
                    f"rank {rank} of a {self.world_size}-rank group did not start in {READY_TIMEOUT_S} s"
                )
            connection.recv()
        self.starts += 1

    def stop(self) -> None:
        for connection in self._connections:
            try:
                connection.send(None)
            except (OSError, BrokenPipeError):
                pass
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes, self._connections = [], []

    def _alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
        """`fn(rank, world_size, *args, **kwargs)` on every rank; the results in rank order. Raises
        RankFailed with each failing rank's exception."""
        self.submit(fn, *args, **kwargs)
        return self.results(timeout)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start `fn` on every rank and return at once (`results` waits for it): two groups can work at
        the same time."""
        if not self._alive():
            self.stop()
            self._start()
        for connection in self._connections:
            connection.send((fn, args, kwargs, os.getcwd()))

    def results(self, timeout: float = 300) -> list[Any]:
        """What every rank's submitted call returned, in rank order (RankFailed if any raised)."""
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        tracebacks: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._connections))
        while pending:
            if errors:
                deadline = min(deadline, time.monotonic() + GRACE_S)
            ready = wait(list(pending.values()), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                break
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    status, value = pending.pop(rank).recv()
                except EOFError:  # the process died (killed, or a fault that kills it)
                    errors[rank] = RuntimeError(
                        f"rank {rank}'s process died (exit code {self._processes[rank].exitcode})"
                    )
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank], tracebacks[rank] = value
        died = any(not process.is_alive() for process in self._processes)
        if pending or died or (errors and self.world_size > 1):
            # Ranks left waiting in a collective, or a process group in an unknown state: a fresh group next
            # time. A single rank that raised has no peer to wait for: it takes the next call.
            self.stop()
        for rank in pending:
            errors.setdefault(rank, TimeoutError(f"rank {rank} returned nothing within {timeout:.0f} s"))
        if errors:
            raise RankFailed(dict(sorted(errors.items())), tracebacks)
        return [results[rank] for rank in range(self.world_size)]

    def train(self, spec: TrialSpec, **kwargs: Any) -> list[dict[str, Any]]:
        """Every rank's measurements of one trial (what each rank reports to Ray Train)."""
        return self.call(train_rank, spec, **kwargs)

    def row(self, spec: TrialSpec, **kwargs: Any) -> dict[str, Any]:
        """The results row of one trial, as the Ray path makes it (ray_zero.run.trial.run_trial): status, all
        ranks aggregated, the prediction beside them; `per_rank` holds each rank's dict."""
        row = trial_row(spec)
        try:
            reports = self.train(spec, **kwargs)
        except RankFailed as failure:
            row.update(failed_row_fields(failure.errors))
        else:
            row.update(status="ok", **aggregate_ranks(reports))
            row["per_rank"] = [{"trial": spec.name, **r} for r in reports]
        return finish_row(row)


class RankGroups:
    """One RankGroup per world size, started when first asked for (the test session's fixture)."""

    def __init__(self):
        self._groups: dict[int, RankGroup] = {}

    def __call__(self, world_size: int) -> RankGroup:
        if world_size not in self._groups:
            self._groups[world_size] = RankGroup(world_size)
        return self._groups[world_size]

    def stop(self) -> None:
        for group in self._groups.values():
            group.stop()
