"""Join the cluster at an address, or start a private Ray; what a joined cluster has (ray_zero/run/plan.py
makes the plan from it)."""

from __future__ import annotations

import os
from typing import Optional

import ray

from ray_zero.config import ConfigError
from ray_zero.run.plan import Cluster
from ray_zero.run.stack import restore_environment
from ray_zero.run.watchdog import worker_setup_hook

NODE_ID_LABEL = "ray.io/node-id"
"""Ray's default label on every node (its id): label selectors place work on a node by it."""
_found_env: list[dict[str, str]] = []
JOB_ENV = {"worker_process_setup_hook": worker_setup_hook()}
"""The sweep's job: every worker process runs watchdog.worker_setup_hook's function as it starts (Ray runs a
setup hook only where the job names it), which puts a trial's Train workers in its trial log."""


class ClusterUnreachable(ConfigError):
    """--address (or RAY_ADDRESS) names no Ray cluster this process can join."""


def start_ray(address: Optional[str], verbose: bool = False) -> tuple[object, Optional[str]]:
    """Join the cluster at `address` (or RAY_ADDRESS, or the Ray this process already runs), else start a
    private Ray whose dashboard binds to 127.0.0.1. Returns (context, the address joined or None).

    Remote processes' output (Ray Train's per-report lines, each rank's warnings) stays in Ray's logs
    unless `verbose`: the terminal shows ray_zero's own lines. This process's environment is noted as
    found (before a private Ray starts, after a cluster is joined) for stop_ray to put back. A Ray this
    process already runs has no JOB_ENV: a trial's worker start is bounded there from its first rank on,
    unless its ray.init named the hook (runtime_env=ray_zero.run.cluster.JOB_ENV)."""
    if ray.is_initialized():
        _found_env[:] = [dict(os.environ)]
        return ray.get_runtime_context(), "the running Ray instance"
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        _found_env[:] = [dict(os.environ)]
        context = ray.init(
            dashboard_host="127.0.0.1", log_to_driver=verbose, configure_logging=False, runtime_env=JOB_ENV
        )
        return context, None
    try:
        context = ray.init(address=address, log_to_driver=verbose, runtime_env=JOB_ENV)
    except (ConnectionError, RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:300]
        raise ClusterUnreachable(
            f"--address {address}: cannot join the Ray cluster ({reason}); start one with "
            "`ray start --head`, or leave --address and RAY_ADDRESS unset for a private Ray"
        ) from None
    _found_env[:] = [dict(os.environ)]  # what joining set stays: the process stays joined
    return context, address


def stop_ray(shutdown: bool = True) -> None:
    """Shut down the private Ray that start_ray started (`shutdown`), and put this process's environment
    back as start_ray found it. Ray and the libraries a sweep loads set variables in it for their own use
    and their child processes: Ray's ray.init RAY_AUTH_MODE, RAY_USAGE_STATS_ENABLED and PYTHONBREAKPOINT
    (Ray's debugger, of a Ray shut down by then), tensorboardX CRC32C_SW_MODE, torch's inductor
    TORCHINDUCTOR_CACHE_DIR. Their in-process state is theirs; the caller's environment is the caller's."""
    if shutdown:
        ray.shutdown()
    if _found_env:
        restore_environment(_found_env.pop())


def head_node_id() -> str:
    """The id of the cluster's head node, through public API: the only node of a one-node cluster; else
    the one Ray's state API marks as head (it needs the cluster's dashboard); else this process's own node,
    where the sweep's trial log lives too (ray_zero/run/trial_log.py)."""
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    if len(alive) == 1:
        return alive[0]
    try:
        from ray.util.state import list_nodes

        heads = list_nodes(filters=[("is_head_node", "=", True), ("state", "=", "ALIVE")], timeout=10)
        if heads:
            return heads[0].node_id
    except Exception:  # noqa: BLE001  no dashboard (ray start --include-dashboard=false): the driver's node
        pass
    return ray.get_runtime_context().get_node_id()


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
