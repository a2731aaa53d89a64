"""Join the cluster at an address, or start a private Ray; what a joined cluster has (ray_zero/run/plan.py
makes the plan from it)."""

from __future__ import annotations

import os
from typing import Optional

import ray

from ray_zero.config import ConfigError
from ray_zero.run.plan import Cluster


class ClusterUnreachable(ConfigError):
    """--address (or RAY_ADDRESS) names no Ray cluster this process can join."""


def start_ray(address: Optional[str], verbose: bool = False) -> tuple[object, Optional[str]]:
    """Join the cluster at `address` (or RAY_ADDRESS, or the Ray this process already runs), else start a
    private Ray whose dashboard binds to 127.0.0.1. Returns (context, the address joined or None).

    Remote processes' output (Ray Train's per-report lines, each rank's warnings) stays in Ray's logs
    unless `verbose`: the terminal shows ray_zero's own lines."""
    if ray.is_initialized():
        return ray.get_runtime_context(), "the running Ray instance"
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        context = ray.init(dashboard_host="127.0.0.1", log_to_driver=verbose, configure_logging=False)
        return context, None
    try:
        return ray.init(address=address, log_to_driver=verbose), address
    except (ConnectionError, RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:300]
        raise ClusterUnreachable(
            f"--address {address}: cannot join the Ray cluster ({reason}); start one with "
            "`ray start --head`, or leave --address and RAY_ADDRESS unset for a private Ray"
        ) from None


def joined_cluster(address: str) -> Cluster:
    total = ray.cluster_resources()
    gpus = int(total.get("GPU", 0))
    return Cluster(
        gpus=gpus,
        cpus=int(total.get("CPU", 0)),
        source=f"the cluster at {address}",
        gpu_memory_gib=cluster_gpu_memory_gib() if gpus else None,
    )


def _this_nodes_smallest_gpu_gib() -> Optional[float]:
    """The smallest GPU's memory on the node this runs on, through NVML (no CUDA context, no torch)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        sizes = [
            pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
            for i in range(pynvml.nvmlDeviceGetCount())
        ]
        return min(sizes) / 1024**3 if sizes else None
    except Exception:  # no NVML on that node: unknown
        return None


def cluster_gpu_memory_gib(timeout_s: float = 60) -> Optional[float]:
    """The smallest GPU's memory over the cluster's GPU nodes (a task on each, placed by node), or None
    when any node does not say within `timeout_s`: GPUs of unknown memory are not shared (run/sweep.py)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU")]
    probe = ray.remote(num_cpus=0)(_this_nodes_smallest_gpu_gib)
    refs = [
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in nodes
    ]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    sizes = [ray.get(ref) for ref in ready]
    if not nodes or len(sizes) < len(nodes) or None in sizes:
        return None
    return min(sizes)
