"""A step's time, and samples/s, at N workers, from one measured row: its compute (forward and backward)
and optimizer time, the bytes the engine sends at N (ray_zero/measure/comm_model.py) and the bus
bandwidth (ray_zero/measure/bandwidth.py). Pure: no Ray, no torch.

* Compute per rank stays what the row measured: each rank trains its own micro-batches of the same size.
* The optimizer step scales with the optimizer states the fullest rank steps (measure/partitions.py):
  halved at 2 ranks under ZeRO-1/2/3, FSDP2 and ZeroRedundancyOptimizer, unchanged under DDP and
  DeepSpeed stage 0.
* Communication: each collective's bytes x nccl-tests' bus factor / busbw, read at the size of the
  messages the engine sends them in (its buckets, or its largest block for ZeRO-3 and FSDP2).

The band is the two ends of overlap: none (forward + backward + optimizer + communication) and full
(max(forward + backward, communication) + optimizer). The point estimate is no overlap less the
communication the measured row shows hidden: a row measured at 2+ ranks hides the share of its predicted
communication that its exposed time did not show (its engine's overlap, carried to N); a row of one rank
shows none, so the point is the no-overlap end. The predicted samples/s scale the row's measured rate by
its step over the predicted step, so that what a step does beyond the split (the loss read back) keeps its
share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ray_zero.measure.bandwidth import Bandwidth
from ray_zero.measure.comm_model import HALF, KINDS, predict_comm
from ray_zero.measure.partitions import held

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default bucket_cap_mb: its all-reduces go out in messages of this size."""


@dataclass(frozen=True)
class SpeedEstimate:
    workers: int
    compute_s: float
    optimizer_s: float
    comm_s: float
    """Time of the step's collectives at the bandwidth, were none of it hidden."""
    hidden_fraction: float
    """Share of comm_s the point estimate takes as hidden behind compute (from the measured row)."""
    step_s: float
    """The point estimate."""
    step_fastest_s: float
    """Full overlap: max(compute, communication) + optimizer."""
    step_slowest_s: float
    """No overlap: compute + optimizer + communication."""
    samples_per_s: float
    samples_per_s_low: float
    samples_per_s_high: float
    comm_bytes: dict

    @property
    def samples_per_s_per_worker(self) -> float:
        return self.samples_per_s / self.workers


def message_bytes(model, backend: str, stage: int, precision: str, bucket_elements: float) -> float:
    """The size of the messages an engine sends its gradients and parameters in (a model without repeated
    blocks gathers its parameters whole)."""
    low = HALF.get(precision, 4)
    if backend == "torch_zero":
        return DDP_BUCKET_BYTES
    if backend == "fsdp" or (backend == "deepspeed" and stage == 3):
        return max(1, model.largest_block_params or getattr(model, "params", 1)) * low
    return bucket_elements * low


def _states(model, backend: str, stage: int, workers: int) -> float:
    return held(
        model.trainable_param_shapes,
        model.frozen_param_shapes,
        backend,
        stage,
        workers,
        getattr(model, "unreached_params", ()),
    ).states


def comm_seconds(
    model, row: dict, workers: int, bandwidth: Bandwidth, bucket_elements: float, accumulation: int = 1
) -> tuple[float, dict]:
    """Seconds of the step's collectives at `workers` ranks, none hidden, and their bytes by kind."""
    backend, stage, precision = row["backend"], int(row["stage"]), row["precision"]
    sent = predict_comm(
        model.trainable_param_shapes,
        model.frozen_param_shapes,
        backend,
        stage,
        workers,
        precision,
        accumulation,
        getattr(model, "buffer_bytes", 0),
        getattr(model, "batch_norm_param_shapes", ()),
    )
    message = message_bytes(model, backend, stage, precision, bucket_elements)
    seconds = sum(
        bandwidth.seconds(kind, sent[kind], workers, min(message, sent[kind])) for kind in KINDS if sent[kind]
    )
    return seconds, sent


def hidden_fraction(
    model, row: dict, bandwidth: Bandwidth, bucket_elements: float, accumulation: int = 1
) -> float:
    """The share of its predicted communication a row measured at 2+ ranks did not show as exposed."""
    workers = int(row["num_workers"])
    exposed = row.get("exposed_comm_s")
    if workers < 2 or exposed is None or exposed != exposed:
        return 0.0
    predicted, _ = comm_seconds(model, row, workers, bandwidth, bucket_elements, accumulation)
    if predicted <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - exposed / predicted))


def predict_speed(
    model,
    row: dict,
    workers: int,
    bandwidth: Bandwidth,
    bucket_elements: float,
    accumulation: int = 1,
    hidden: Optional[float] = None,
) -> Optional[SpeedEstimate]:
    """The step and samples/s at `workers` ranks from a measured row (a trial row with the step split:
    forward_s, backward_s, optimizer_s, exposed_comm_s, step_s, samples_per_s, the point's backend,
    stage, precision, num_workers, micro_batch_size); None when the row has no split."""
    needed = ("forward_s", "backward_s", "optimizer_s", "step_s", "samples_per_s")
    if any(row.get(k) is None or row.get(k) != row.get(k) for k in needed):
        return None
    measured_workers = int(row["num_workers"])
    backend, stage = row["backend"], int(row["stage"])
    compute = float(row["forward_s"]) + float(row["backward_s"])
    states_then = _states(model, backend, stage, measured_workers)
    optimizer = float(row["optimizer_s"]) * (
        _states(model, backend, stage, workers) / states_then if states_then else 1.0
    )
    comm, sent = comm_seconds(model, row, workers, bandwidth, bucket_elements, accumulation)
    if hidden is None:
        hidden = hidden_fraction(model, row, bandwidth, bucket_elements, accumulation)
    slowest = compute + optimizer + comm
    fastest = max(compute, comm) + optimizer
    point = max(fastest, slowest - hidden * comm)
    # The row's rate over its own step: what its step does beyond the split keeps its share.
    per_step = float(row["samples_per_s"]) * float(row["step_s"]) / measured_workers

    def rate(step: float) -> float:
        return workers * per_step / step if step > 0 else math.nan

    return SpeedEstimate(
        workers=workers,
        compute_s=compute,
        optimizer_s=optimizer,
        comm_s=comm,
        hidden_fraction=hidden,
        step_s=point,
        step_fastest_s=fastest,
        step_slowest_s=slowest,
        samples_per_s=rate(point),
        samples_per_s_low=rate(slowest),
        samples_per_s_high=rate(fastest),
        comm_bytes=sent,
    )
