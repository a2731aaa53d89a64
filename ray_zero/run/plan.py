"""What a sweep can use and the plan it makes from it: count GPUs and CPUs, split the grid into points that
run and points that are skipped, decide how many trials run at once, refuse a model that cannot fit. No
Ray here (the harness and scripts/zoo.py plan without it); ray_zero/run/cluster.py joins or starts Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import psutil

from ray_zero.config import ConfigError, Experiment, Point
from ray_zero.measure.engine_memory import engine_prediction
from ray_zero.measure.prediction import GIB


@dataclass(frozen=True)
class Cluster:
    """GPUs and CPUs in total, and where they come from."""

    gpus: int
    cpus: int
    source: str
    """'this machine' before a private Ray starts, or the address of the cluster."""
    gpu_memory_gib: Optional[float] = None
    """Memory of one GPU of this machine (None on CPU or when the GPUs are elsewhere)."""

    def worker_capacity(self, experiment: Experiment, use_gpu: bool) -> int:
        return self.gpus if use_gpu else self.cpus // experiment.runtime.cpus_per_worker


@dataclass(frozen=True)
class Plan:
    """The grid split into what runs and what is skipped, with the settings every trial shares."""

    use_gpu: bool
    precision: str
    runnable: list[Point]
    skipped: list[tuple[Point, str]]
    max_concurrent_trials: int
    capacity: int
    started_early: int = 0
    """Trials whose driver and controller start before GPUs or CPUs are free for them."""

    @property
    def trial_drivers(self) -> int:
        """Trials Tune runs at once: those training, plus any started early."""
        return self.max_concurrent_trials + self.started_early


def local_cluster() -> Cluster:
    import torch

    gpus = torch.cuda.device_count()
    memory = torch.cuda.get_device_properties(0).total_memory / 1024**3 if gpus else None
    return Cluster(gpus=gpus, cpus=os.cpu_count() or 1, source="this machine", gpu_memory_gib=memory)


def plan_sweep(experiment: Experiment, cluster: Cluster, points: Optional[list[Point]] = None) -> Plan:
    """Decide device, precision, which points run and how many at once. Raises ConfigError."""
    if experiment.device == "gpu" and cluster.gpus == 0:
        raise ConfigError(f"device: gpu, but {cluster.source} has no GPU (use device: cpu or auto)")
    use_gpu = experiment.use_gpu(cluster.gpus > 0)
    precision = experiment.resolved_precision(use_gpu)
    if precision == "fp16" and not use_gpu:
        raise ConfigError(
            f"precision: fp16 needs a GPU and {cluster.source} has none (use fp32 or bf16 on CPU)"
        )
    capacity = cluster.worker_capacity(experiment, use_gpu)
    points = experiment.grid.points() if points is None else points
    unit = "GPUs" if use_gpu else "CPU workers"
    runnable = [p for p in points if p.num_workers <= capacity]
    skipped = [
        (p, f"needs {p.num_workers} workers; {cluster.source} has room for {capacity} {unit}")
        for p in points
        if p.num_workers > capacity
    ]
    if not runnable:
        raise ConfigError(
            "grid.num_workers: no grid point can run: the smallest asks for "
            f"{min(p.num_workers for p in points)} "
            f"workers, {cluster.source} has room for {capacity} ({cluster.gpus if use_gpu else cluster.cpus} "
            f"{'GPUs' if use_gpu else f'CPUs at runtime.cpus_per_worker={experiment.runtime.cpus_per_worker}'}); "  # noqa: E501
            f"allowed: 1 to {capacity}"
        )
    largest = max(p.num_workers for p in runnable)
    concurrent = max(1, capacity // largest)
    if experiment.runtime.max_concurrent_trials is not None:
        concurrent = min(concurrent, experiment.runtime.max_concurrent_trials)
    overlap = (
        experiment.runtime.overlap_startup if experiment.runtime.overlap_startup is not None else use_gpu
    )
    # One more trial may start only if it then has to wait: were it to fit beside the others, it would
    # train at once, past max_concurrent_trials.
    smallest = min(p.num_workers for p in runnable)
    early = int(overlap and len(runnable) > concurrent and (concurrent + 1) * smallest > capacity)
    unsupported = [(p, reason) for p, reason in experiment.grid.points_unsupported()]
    return Plan(use_gpu, precision, runnable, skipped + unsupported, concurrent, capacity, early)


def check_model_fits(experiment: Experiment, params: int, cluster: Cluster, plan: Plan) -> None:
    """Refuse a model of `params` parameters whose predicted model states alone exceed every worker's
    memory at every point. On GPU a worker has one GPU; on CPU the workers of a node share its memory."""
    if plan.use_gpu:
        if not cluster.gpu_memory_gib:
            return  # the GPUs are on other nodes: nothing known here
        budget, what = cluster.gpu_memory_gib * GIB, f"one GPU's {cluster.gpu_memory_gib:.1f} GiB"
    else:
        budget, what = float(psutil.virtual_memory().total), "this machine's memory"
    needs = {}
    for point in plan.runnable:
        per_rank = engine_prediction(
            point.backend,
            params,
            point.stage,
            point.num_workers,
            plan.precision,
            offload=point.offload_optimizer,
        ).model_state_bytes
        needs[point.name] = per_rank * (1 if plan.use_gpu else point.num_workers)
    if needs and min(needs.values()) > budget:
        name = min(needs, key=needs.get)
        raise ConfigError(
            f"model {experiment.model}: {params:,} parameters need {needs[name] / GIB:.1f} GiB "
            f"of model states per {'rank' if plan.use_gpu else 'trial'} even at its smallest point "
            f"({name}, memory model), more than {what}; try more workers or a higher stage"
        )
