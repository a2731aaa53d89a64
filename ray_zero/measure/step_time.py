"""A step's time on a GPU from its traced operators and the GPU's profile (measure/gpu_profile.py): a
roofline per kernel class, and the host's launches beside it. Pure: no torch.

* Each bucket of alike operators (OpCost: kind, dtype, a size bucket) takes the larger of its FLOPs over
  what its kind reaches at its size per call, and its bytes over the bandwidth at its size per call
  (elementwise's, for a compute kind's bytes): "compute" where the first is larger, "memory" otherwise.
  Memory kinds (elementwise, reduction, random) have bytes only.
* The host launches one kernel per operator (views launch none and are not in the list) at the profile's
  seconds per launch; it runs ahead of the GPU, so a micro-batch takes the larger of the device's sum and
  the host's.
* A step is its micro-batches and one optimizer step: the parameters the fullest rank steps over what
  the profile's AdamW step reaches at that count.
* The engine's own work (measure/engine_time.py adds it): its hooks run on the host beside the launches
  (hooks_s), and the communication its overlap rule leaves exposed follows the micro-batches (comm_s).

Not counted yet: the engine's copies (DeepSpeed's flat buffers, FSDP2's casts) beyond the traced
operators, the optimizer's launches, the loss read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ray_zero.measure.gpu_profile import MEMORY, OPTIMIZER, Profile


@dataclass(frozen=True)
class OpCost:
    """`count` operators of one kind, dtype and size bucket, and their FLOPs and bytes moved (summed)."""

    kind: str
    dtype: str
    count: int
    flops: float
    bytes: float


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    """Device time of the operators whose FLOPs set their time, per micro-batch."""
    memory_s: float
    """Device time of the operators whose bytes set their time, per micro-batch."""
    host_s: float
    """The host's launches, per micro-batch."""
    optimizer_s: float
    launches: int
    accumulation: int = 1
    hooks_s: float = 0.0
    """The host's time in the engine's hooks, per micro-batch (0: none, or not counted)."""
    comm_s: float = 0.0
    """The step's communication the engine does not hide behind compute (engine_time.py), per step."""

    @property
    def device_s(self) -> float:
        return self.compute_s + self.memory_s

    @property
    def micro_batch_s(self) -> float:
        """One micro-batch: the device's time or the host's (launches and hooks), whichever is longer."""
        return max(self.device_s, self.host_s + self.hooks_s)

    @property
    def step_s(self) -> float:
        return self.accumulation * self.micro_batch_s + self.optimizer_s + self.comm_s

    @property
    def bound(self) -> str:
        """The term that sets the step: communication (where its exposed part outlasts the micro-batches),
        host, compute or memory (bandwidth)."""
        if self.comm_s > self.accumulation * self.micro_batch_s:
            return "communication"
        if self.host_s + self.hooks_s > self.device_s:
            return "host"
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def samples_per_s(self, micro_batch: int, workers: int = 1) -> float:
        return workers * micro_batch * self.accumulation / self.step_s


def op_seconds(op: OpCost, profile: Profile) -> tuple[float, float]:
    """(compute seconds, memory seconds) of a bucket: the roofline's larger term, the other 0."""
    if op.count <= 0:
        return 0.0, 0.0
    bandwidth = "elementwise" if op.kind not in MEMORY else op.kind
    memory = op.bytes / profile.rate(bandwidth, op.dtype, op.bytes / op.count) if op.bytes else 0.0
    if op.kind in MEMORY or not op.flops:
        return 0.0, memory
    compute = op.flops / profile.rate(op.kind, op.dtype, op.flops / op.count)
    return (compute, 0.0) if compute >= memory else (0.0, memory)


def predict_step(
    ops: Iterable[OpCost], profile: Profile, stepped_params: float = 0.0, accumulation: int = 1
) -> StepTime:
    """The step of `accumulation` micro-batches, each the traced `ops`, and an optimizer step over
    `stepped_params` (the fullest rank's)."""
    compute = memory = 0.0
    launches = 0
    for op in ops:
        c, m = op_seconds(op, profile)
        compute, memory, launches = compute + c, memory + m, launches + op.count
    optimizer = stepped_params / profile.rate(OPTIMIZER, "fp32", stepped_params) if stepped_params else 0.0
    return StepTime(compute, memory, launches * profile.launch_s, optimizer, launches, accumulation)
