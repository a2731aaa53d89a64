"""The engine's own work in a predicted step (measure/step_time.py): the host's time in its hooks, and its
collectives (measure/comm_model.py's bytes at measure/bandwidth.py's busbw, sent in the engine's messages:
speed_model.message_bytes) less what it hides behind compute. Pure: no torch.

Hooks run on the host beside the kernel launches, at the profile's seconds per hook (a bare module hook:
the floor; none counted where the profile has no figure). Per micro-batch, from the model's counts:
DeepSpeed stage 3 four per module (before and after its forward and backward) and one per trainable
parameter (its gradient's), stages 1-2 one per trainable parameter, stage 0 none; FSDP2 four per group
(each block, the root, and under half precision each BatchNorm); DDP one per 25 MiB gradient bucket, in the
boundary's micro-batch only.

A pass's collectives run beside that pass's device time; what outlasts it, and the one message the pass
cannot hide (the first a forward gathers, the last a backward reduces), are exposed. A micro-batch's
forward and backward split its time 1 : 2 (a backward's two matmuls per forward one; the traced step does
not tell them apart yet). Each engine's rule is read from its code and is an assumption to be checked on a
GPU (issue 67); at one worker nothing is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from ray_zero.measure.bandwidth import Bandwidth
from ray_zero.measure.comm_model import HALF, KINDS, predict_for
from ray_zero.measure.speed_model import DDP_BUCKET_BYTES, message_bytes
from ray_zero.measure.step_time import StepTime

BACKWARD_SHARE = 2 / 3
"""The backward's share of a micro-batch's time (an assumption: the trace does not split them yet)."""


@dataclass(frozen=True)
class EngineTime:
    """What the engine adds to a step."""

    hooks: float
    """Hook calls per micro-batch (averaged over the step's micro-batches)."""
    hooks_s: float
    """The host's time in them per micro-batch; 0 where the profile has no seconds per hook."""
    comm_s: float = 0.0
    """The step's collectives at the bandwidth, none hidden."""
    exposed_s: float = 0.0
    """What of comm_s the engine's overlap rule leaves on the step."""
    sent: dict = field(default_factory=dict)
    """Bytes by collective kind, per step (comm_model.predict_comm)."""


def hooks_per_micro_batch(model, backend: str, stage: int, precision: str, accumulation: int = 1) -> float:
    """The engine's hook calls per micro-batch from the model's counts (0 for a count the description
    lacks: descriptions of earlier versions)."""
    params = len(model.trainable_param_shapes)
    if backend == "deepspeed":
        return 4 * getattr(model, "modules", 0) + params if stage == 3 else params if stage in (1, 2) else 0
    if backend == "fsdp":
        norms = len(getattr(model, "batch_norm_param_shapes", ())) // 2 if precision in HALF else 0
        return 4 * (getattr(model, "blocks", 0) + 1 + norms)
    if backend == "torch_zero":
        gradient_bytes = 4 * sum(math.prod(s) for s in model.trainable_param_shapes)
        return math.ceil(gradient_bytes / DDP_BUCKET_BYTES) / accumulation
    raise ValueError(f"no hook count for backend {backend!r}")


def _behind(comm: float, window: float, one: float) -> float:
    """Exposed time of `comm` seconds run beside `window` seconds of compute, one message of `one` seconds
    unhidden."""
    return min(comm, max(0.0, comm - window) + one)


def exposed_seconds(
    seconds: dict, one: dict, backend: str, stage: int, accumulation: int, micro_batch_s: float
) -> float:
    """The exposed part of a step's collectives (`seconds` by kind, per step; `one`: one message's) under
    the engine's overlap rule."""
    g = accumulation
    forward, backward = (1 - BACKWARD_SHARE) * micro_batch_s, BACKWARD_SHARE * micro_batch_s
    t, one = dict.fromkeys(KINDS, 0.0) | seconds, dict.fromkeys(KINDS, 0.0) | one
    ar, rs, ag = t["all_reduce"], t["reduce_scatter"], t["all_gather"]
    if backend == "torch_zero":
        # DDP: its bucketed all-reduce runs beside the boundary's backward; buffer, ZeRO-1 broadcasts do not
        return _behind(ar, backward, one["all_reduce"]) + t["broadcast"]
    if backend == "deepspeed" and stage in (0, 1, 2):
        # DeepSpeed 0-2: overlap_comm is off below stage 3 by default (ray_zero leaves it): reduction in
        # the backward's stream, the all-gather of updated parameters after the step; nothing hidden
        return ar + ag + rs
    if backend == "deepspeed":
        # ZeRO-3 (overlap_comm on): gathers (once a micro-batch, held to backward) prefetched beside the
        # forward, reduce-scatters beside the backward; the gradient norm's all-reduce after
        gathers = _behind(ag / g, forward, one["all_gather"])
        return g * (gathers + _behind(rs / g, backward, one["reduce_scatter"])) + ar
    if backend == "fsdp":
        # FSDP2: gathers prefetched beside the forward (stage 3: half of them again beside the backward,
        # with the reduce-scatters)
        in_forward = ag / g / (2 if stage == 3 else 1)
        gathers = _behind(in_forward, forward, one["all_gather"])
        in_backward = ag / g - in_forward + rs / g
        return g * (gathers + _behind(in_backward, backward, one["reduce_scatter"]))
    raise ValueError(f"no overlap rule for backend {backend!r}")


def engine_time(
    step: StepTime,
    model,
    point,
    precision: str,
    bandwidth: Optional[Bandwidth],
    hook_s: Optional[float],
    bucket_elements: float,
) -> tuple[StepTime, EngineTime]:
    """`step` (its micro-batches' kernels and optimizer step) with the engine's hooks and exposed
    communication added, and those terms; communication is not counted without a bandwidth."""
    backend, stage, workers, g = point.backend, point.stage, point.num_workers, step.accumulation
    hooks = hooks_per_micro_batch(model, backend, stage, precision, g)
    hooked = replace(step, hooks_s=hooks * (hook_s or 0.0))
    if workers < 2 or bandwidth is None:
        return hooked, EngineTime(hooks, hooked.hooks_s)
    sent = predict_for(model, point, precision, g)
    message = message_bytes(model, backend, stage, precision, bucket_elements)
    seconds, one = {}, {}
    for kind in KINDS:
        if sent[kind]:
            size = min(message, sent[kind])
            seconds[kind] = bandwidth.seconds(kind, sent[kind], workers, size)
            one[kind] = bandwidth.seconds(kind, size, workers, size)
    exposed = exposed_seconds(seconds, one, backend, stage, g, hooked.micro_batch_s)
    terms = EngineTime(hooks, hooked.hooks_s, sum(seconds.values()), exposed, sent)
    return replace(hooked, comm_s=exposed), terms
