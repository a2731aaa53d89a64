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
    return Cluster(
        gpus=int(total.get("GPU", 0)), cpus=int(total.get("CPU", 0)), source=f"the cluster at {address}"
    )
