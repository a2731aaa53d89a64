"""The bytes each engine sends in one optimizer step, by collective, predicted from the parameters'
shapes as the memory model predicts what ranks hold (ray_zero/measure/partitions.py). A message is sized
as nccl-tests sizes it, and as ray_zero/train/comm.py counts it on every rank: an all-reduce's or a
broadcast's tensor, a reduce-scatter's whole input, an all-gather's whole output. Read from the engines'
code and checked to the byte on 2 CPU ranks for every engine and stage (tests/test_zoo.py):

* DeepSpeed stage 0: the trainable gradients all-reduced once per step, in the parameters' dtype.
* ZeRO-1/2: the same all-reduce (stage 2 every micro-batch, stage 1 at the boundary) plus the gradient
  norm (one fp32) and, in fp16/bf16, the overflow flag (one byte); after the step, the flat buffer
  (padded to 2N elements) all-gathered in the parameters' dtype.
* ZeRO-3: each gradient reduce-scattered every micro-batch, padded to N; the gathered parameters once per
  micro-batch (held from forward to backward: DeepSpeed's reuse distance is unbounded by default) but those
  kept whole on every rank (at most stage3_param_persistence_threshold elements), which are gathered once
  after the step; the norm (two fp32).
* DDP (torch_zero 0): the trainable gradients all-reduced in fp32 at the boundary; the floating buffers
  broadcast from rank 0 before every forward. ZeroRedundancyOptimizer (torch_zero 1) adds each
  parameter broadcast from the rank that stepped it.
* FSDP2: each parameter's padded first dimension gathered before every forward (stage 3: and again before
  the backward), in the computing dtype (BatchNorm groups in fp32); gradients reduce-scattered in fp32
  every micro-batch. Frozen parameters are gathered too; only trainable ones have gradients.
Integer and boolean bookkeeping (ids, lengths) is not data and is not counted; at one rank nothing is.
"""

from __future__ import annotations

import math
from typing import Sequence

from ray_zero.measure.partitions import DEEPSPEED_PERSISTENCE_THRESHOLD, zero12_partitions

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
HALF = {"fp16": 2, "bf16": 2}

Shape = Sequence[int]


def _padded(size: int, n: int) -> int:
    return math.ceil(size / n) * n


def _rows_padded(shape: Shape, n: int) -> int:
    """FSDP2's gathered size of a tensor: its first dimension padded to a multiple of N."""
    return _padded(shape[0], n) * math.prod(shape[1:]) if shape else n


def predict_comm(
    trainable_shapes: Sequence[Shape],
    frozen_shapes: Sequence[Shape],
    backend: str,
    stage: int,
    num_workers: int,
    precision: str,
    accumulation: int = 1,
    buffer_bytes: int = 0,
    batch_norm_shapes: Sequence[Shape] = (),
) -> dict[str, int]:
    """Bytes of each kind of collective one rank takes part in, per optimizer step of `accumulation`
    micro-batches."""
    sent = dict.fromkeys(KINDS, 0)
    n, g = num_workers, accumulation
    if n <= 1:
        return sent
    trainable = [math.prod(s) for s in trainable_shapes]
    every = trainable + [math.prod(s) for s in frozen_shapes]
    low = HALF.get(precision, 4)  # the dtype DeepSpeed's parameters and gradients are in
    if backend == "deepspeed":
        if stage in (0, 1, 2):
            sent["all_reduce"] = low * sum(trainable) * (g if stage == 2 else 1)
        if stage in (1, 2):
            partition, _ = zero12_partitions(trainable, n)
            sent["all_reduce"] += 4 + (1 if precision in HALF else 0)  # the gradient norm, the overflow flag
            sent["all_gather"] = low * partition * n
        if stage == 3:
            sent["reduce_scatter"] = low * g * sum(_padded(s, n) for s in trainable)
            whole = [s for s in every if s <= DEEPSPEED_PERSISTENCE_THRESHOLD]
            split = [s for s in every if s > DEEPSPEED_PERSISTENCE_THRESHOLD]
            gathered = g * sum(_padded(s, n) for s in split) + sum(_padded(s, n) for s in whole)
            sent["all_gather"] = low * gathered
            sent["all_reduce"] = 8
    elif backend == "torch_zero":
        sent["all_reduce"] = 4 * sum(trainable)
        sent["broadcast"] = g * buffer_bytes + (4 * sum(trainable) if stage == 1 else 0)
    elif backend == "fsdp":
        norms = list(batch_norm_shapes) if precision in HALF else []  # gathered apart, in fp32
        passes = 2 if stage == 3 else 1  # stage 3 gathers again for the backward
        gathered = low * sum(_rows_padded(s, n) for s in (*trainable_shapes, *frozen_shapes))
        gathered += (4 - low) * sum(_rows_padded(s, n) for s in norms)
        sent["all_gather"] = g * passes * gathered
        sent["reduce_scatter"] = 4 * g * sum(_rows_padded(s, n) for s in trainable_shapes)
    else:
        raise ValueError(f"no communication model for backend {backend!r}")
    return sent


def predict_for(model, point, precision: str, accumulation: int) -> dict[str, int]:
    """`predict_comm` for a model description (ray_zero.models.ModelInfo) and a grid point."""
    return predict_comm(
        model.trainable_param_shapes,
        model.frozen_param_shapes,
        point.backend,
        point.stage,
        point.num_workers,
        precision,
        accumulation,
        getattr(model, "buffer_bytes", 0),
        getattr(model, "batch_norm_param_shapes", ()),
    )
