"""`python -m ray_zero bandwidth`: the bus bandwidth between N workers of the cluster, for `estimate`'s
speed prediction. One TorchTrainer run of N workers (a GPU each with NCCL, or a CPU each with gloo), each
rank running ray_zero/train/collective_bench.py; their rows go to a JSON file that
ray_zero/measure/bandwidth.py reads.

Input is checked, and the worker count settled, before Ray starts wherever that can be known: at one
worker there is no peer to measure against, and nothing starts.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from ray_zero.config import ConfigError
from ray_zero.console import log
from ray_zero.measure.bandwidth import FILE_KIND
from ray_zero.run.plan import Cluster, local_cluster

MIB = 2**20
DEVICES = ("auto", "gpu", "cpu")
NOTHING_TO_MEASURE = "bandwidth: 1 worker has no peer: nothing to measure (give --workers 2 or more)"


class BandwidthFailed(RuntimeError):
    """The TorchTrainer run failed (a worker died or raised): one line says how."""


def _power_of_two(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and not value & (value - 1)


def check_bandwidth_input(
    workers: Optional[int], device: str, min_mib: int, max_mib: int, iterations: int = 20
) -> None:
    """Bad input: one ConfigError line naming the problem and what is allowed, before Ray starts."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ConfigError(f"--workers: give a whole number of workers, 1 or more, not {workers!r}")
    if device not in DEVICES:
        raise ConfigError(f"--device: give one of {', '.join(DEVICES)}, not {device!r}")
    for name, value in (("--min-mib", min_mib), ("--max-mib", max_mib)):
        if not _power_of_two(value):
            raise ConfigError(f"{name}: give a power of two of MiB (1, 2, 4, ..., 1024), not {value!r}")
    if min_mib > max_mib:
        raise ConfigError(f"--min-mib {min_mib} is above --max-mib {max_mib}: give min <= max")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ConfigError(f"--iterations: give a whole number of timed calls, 1 or more, not {iterations!r}")


def message_sizes(min_mib: int, max_mib: int) -> list[int]:
    """Bytes of every message: the powers of two from min_mib to max_mib MiB."""
    return [2**exponent * MIB for exponent in range(min_mib.bit_length() - 1, max_mib.bit_length())]


def settle_workers(workers: Optional[int], device: str, cluster: Cluster) -> tuple[int, bool]:
    """(workers, use_gpu) on `cluster`: "auto" is the GPUs where it has them; the default worker count is
    its GPUs, or 2 CPU workers. Asking for more than it has would leave the run waiting for ever: refused."""
    if device == "gpu" and cluster.gpus == 0:
        raise ConfigError(f"--device gpu: {cluster.source} has no GPU (give --device cpu or auto)")
    use_gpu = device == "gpu" or (device == "auto" and cluster.gpus > 0)
    if workers is None:
        workers = cluster.gpus if use_gpu else 2
    room, unit = (cluster.gpus, "GPUs") if use_gpu else (cluster.cpus, "CPUs, one a worker")
    if workers > room:
        allowed = {0: "", 1: "give --device cpu for CPU workers", 2: "give 2"}.get(room, f"give 2 to {room}")
        raise ConfigError(f"--workers {workers}: {cluster.source} has {room} {unit}; {allowed}")
    return workers, use_gpu


def bandwidth_file(rows: list[dict], workers: int, backend: str, where: str, command: str) -> dict[str, Any]:
    """The file's content, as ray_zero/measure/bandwidth.py reads it, with its provenance beside the rows
    (the same date format and versions as a sweep's, ray_zero/run/session.py)."""
    return {
        "kind": FILE_KIND,
        "workers": workers,
        "backend": backend,
        "where": where,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "ray": importlib.metadata.version("ray"),
        },
        "command": command,
        "results": rows,
    }


def write_bandwidth_file(path: Path, content: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1) + "\n")
    return path


def bandwidth_table(path: Path) -> str:
    """A bandwidth file for the console: where it was measured, then collective, MiB, time ms, algbw and
    busbw GB/s."""
    content = json.loads(path.read_text())
    lines = [
        f"bandwidth: {content['where']}, {content['backend']}",
        f"{'collective':<15}{'MiB':>7}{'time ms':>11}{'algbw GB/s':>12}{'busbw GB/s':>12}",
    ]
    for row in content["results"]:
        lines.append(
            f"{row['collective']:<15}{row['bytes'] / MIB:>7.4g}{row['time_s'] * 1e3:>11.3f}"
            f"{row['algbw_gbps']:>12.3f}{row['busbw_gbps']:>12.3f}"
        )
    return "\n".join(lines)


def _hardware(device) -> str:
    """The device's name: the GPU's, or the CPU's model as /proc/cpuinfo gives it."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def bandwidth_loop(config: dict[str, Any]) -> None:
    """Ray Train entry point on every worker: measure; rank 0 sends the rows (the same on every rank)."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    from ray_zero.train.collective_bench import measure_collectives

    device = ray.train.torch.get_device() if config["use_gpu"] else torch.device("cpu")
    rows = measure_collectives(device, config["sizes"], iterations=config["iterations"])
    # How many nodes the workers were on: the largest node rank, + 1 (a tensor on the device, as NCCL wants).
    node_rank = torch.tensor([ray.train.get_context().get_node_rank()], device=device)
    dist.all_reduce(node_rank, op=dist.ReduceOp.MAX)
    if ray.train.get_context().get_world_rank() == 0:
        config["inbox"].put({"rows": rows, "hardware": _hardware(device), "nodes": int(node_rank.item()) + 1})


def _measure(workers: int, use_gpu: bool, sizes: list[int], iterations: int, private_ray: bool) -> dict:
    """One TorchTrainer run of `workers` ranks; what rank 0 sent. Not through `ray.train.report`: in Ray
    Train V2 a run's Result carries metrics only beside a checkpoint, and a checkpoint needs storage that
    every node reaches. A queue reaches the driver from any node."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from ray_zero.run.trial import train_environment

    train_environment(private_ray)  # the sweep's Ray Train settings
    inbox = Queue(actor_options={"num_cpus": 0})  # beside the workers, not in their CPUs
    storage = tempfile.mkdtemp(prefix="ray_zero-bandwidth-")  # Ray Train's run state; nothing to keep
    try:
        TorchTrainer(
            bandwidth_loop,
            train_loop_config={"use_gpu": use_gpu, "sizes": sizes, "iterations": iterations, "inbox": inbox},
            scaling_config=ScalingConfig(
                num_workers=workers,
                use_gpu=use_gpu,
                resources_per_worker={"CPU": 1, **({"GPU": 1} if use_gpu else {})},
                placement_strategy="PACK",  # as a sweep's trials are placed (runtime.placement_strategy)
            ),
            run_config=RunConfig(
                name="bandwidth",
                storage_path=storage,
                # A measurement that failed once is reported, not repeated: it would fail the same way.
                failure_config=FailureConfig(max_failures=0, controller_failure_limit=0),
                logging_config=LoggingConfig(log_level="WARNING"),
            ),
        ).fit()
        return inbox.get(timeout=60)
    except TrainingFailedError as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise BandwidthFailed(f"bandwidth: the run failed ({reason})") from None
    finally:
        inbox.shutdown()
        shutil.rmtree(storage, ignore_errors=True)


def run_bandwidth(
    workers: Optional[int],
    device: str = "auto",
    min_mib: int = 1,
    max_mib: int = 1024,
    output: Path = Path("bandwidth.json"),
    command: str = "",
    address: Optional[str] = None,
    iterations: int = 20,
    private_ray: bool = True,
) -> Optional[Path]:
    """Measure, and write `output`; None, and one line saying so, at one worker. `private_ray`: Ray will
    start on this machine (ray_zero.api.checks_here), whose GPUs are then known before it starts."""
    check_bandwidth_input(workers, device, min_mib, max_mib, iterations)
    if workers == 1:
        log.warning(NOTHING_TO_MEASURE)
        return None
    if private_ray:
        workers, use_gpu = settle_workers(workers, device, local_cluster())
        if workers < 2:
            log.warning(f"bandwidth: this machine has {workers} GPU, no peer: nothing to measure")
            return None

    import ray

    from ray_zero.run.cluster import start_ray

    _, joined = start_ray(address)
    try:
        if joined:
            total = ray.cluster_resources()
            cluster = Cluster(int(total.get("GPU", 0)), int(total.get("CPU", 0)), f"the cluster at {joined}")
            workers, use_gpu = settle_workers(workers, device, cluster)
            if workers < 2:
                log.warning(f"bandwidth: {cluster.source} has {workers} GPU, no peer: nothing to measure")
                return None
        log.info(
            f"bandwidth: {workers} {'GPU' if use_gpu else 'CPU'} workers, messages of {min_mib} to "
            f"{max_mib} MiB"
        )
        sizes = message_sizes(min_mib, max_mib)
        metrics = _measure(workers, use_gpu, sizes, iterations, private_ray=not joined)
    finally:
        if not joined:
            ray.shutdown()
    nodes = metrics["nodes"]
    on = "one node" if nodes == 1 else f"{nodes} nodes"
    if use_gpu:
        where = f"{workers} x {metrics['hardware']}, {on}"
    else:
        where = f"{workers} CPU workers on {on} ({metrics['hardware']})"
    backend = "nccl" if use_gpu else "gloo"
    return write_bandwidth_file(output, bandwidth_file(metrics["rows"], workers, backend, where, command))
