"""A rank's part of `python -m ray_zero bandwidth`: all-reduce, reduce-scatter and all-gather of float32
messages (nccl-tests' default type) at each size, timed as nccl-tests times them. torch.distributed only:
the same under Ray Train, torchrun or a test.

A message of S bytes is the all-reduce's tensor, the reduce-scatter's whole input, the all-gather's whole
output (ray_zero/measure/bandwidth.py). Per size: one call to learn its time, a few warm-up calls, then
up to `iterations` timed calls, fewer where they would take more than `seconds_per_size` (gloo moves
large messages a thousand times slower than a GPU pair). The time of a call is the slowest rank's mean,
so every rank returns the same rows.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ray_zero.measure.bandwidth import GB, MEASURED, bus_factor

FLOAT32_BYTES = 4
# torch 2.14 renamed the tensor forms (the old names warn, deprecated); gloo runs both under either name.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _collective(kind: str, message: torch.Tensor, share: torch.Tensor):
    """One call of `kind` on `message` (the whole tensor) and `share` (a rank's 1/N of it)."""
    if kind == "all_reduce":
        return lambda: dist.all_reduce(message)
    if kind == "reduce_scatter":
        return lambda: _reduce_scatter(share, message)
    return lambda: _all_gather(message, share)


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (float64: a per-call time of microseconds keeps its digits)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(call, calls: int, device: torch.device) -> float:
    """Seconds per call of `calls` back-to-back calls on this rank, started together with the others."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the barrier's own kernel is not in the timed window
    started = time.perf_counter()
    for _ in range(calls):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # NCCL calls return once queued: wait for the last to finish
    return (time.perf_counter() - started) / calls


def measure_collectives(
    device: torch.device,
    sizes: list[int],
    iterations: int = 20,
    warmup: int = 5,
    seconds_per_size: float = 1.0,
) -> list[dict]:
    """One row per collective and message size in bytes: {"collective", "bytes", "iterations", "time_s",
    "algbw_gbps", "busbw_gbps"}. `iterations` and `warmup` are nccl-tests' -n 20 and -w 5, cut where
    `iterations` calls would take more than `seconds_per_size`; every rank returns the same rows."""
    world = dist.get_world_size()
    dist.barrier()  # NCCL creates its communicator at the first collective: not in any timing
    rows = []
    for kind in MEASURED:
        for size in sizes:
            # A message splits into N equal shares: nccl-tests too rounds its count down to a multiple of N.
            elements = size // FLOAT32_BYTES // world * world
            message = torch.ones(elements, dtype=torch.float32, device=device)
            share = torch.empty(elements // world, dtype=torch.float32, device=device)
            call = _collective(kind, message, share)
            # The first call's time (every rank's slowest) sets how many calls fit in the time bound; the
            # ranks agree on it, as they must, or some would wait in a collective the others never start.
            first = _slowest(_timed(call, 1, device), device)
            calls = max(1, min(iterations, int(seconds_per_size / max(first, 1e-9))))
            for _ in range(min(warmup, calls)):
                call()
            seconds = _slowest(_timed(call, calls, device), device)
            algbw = elements * FLOAT32_BYTES / seconds / GB
            rows.append(
                {
                    "collective": kind,
                    "bytes": elements * FLOAT32_BYTES,
                    "iterations": calls,
                    "time_s": seconds,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * bus_factor(kind, world),
                }
            )
            del message, share, call  # the next size's tensors may need this one's memory
    return rows
