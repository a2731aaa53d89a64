"""Which engine runs which ZeRO stage, and a grid's Point: one trial's engine, stage, micro-batch size,
workers, checkpointing and offload."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

Stage = Literal[0, 1, 2, 3]
BACKEND_STAGES = {"deepspeed": (0, 1, 2, 3), "torch_zero": (0, 1), "fsdp": (2, 3)}
"""The ZeRO stages each engine has: torch_zero is DDP (stage 0) or DDP + ZeroRedundancyOptimizer (stage 1);
FSDP2 keeps gradients sharded (stage 2, reshard_after_forward=False) and parameters too (stage 3)."""
Backend = Literal["deepspeed", "torch_zero", "fsdp"]
Offload = Literal["none", "cpu"]
OFFLOADS = ("none", "cpu")


def unsupported(backend: str, stage: int, offload_optimizer: str = "none") -> Optional[str]:
    """Why no engine can run this point, in one phrase; None when one can."""
    if backend not in BACKEND_STAGES:
        return f"backend must be one of {', '.join(BACKEND_STAGES)}, not {backend!r}"
    if offload_optimizer not in OFFLOADS:
        return f"offload_optimizer must be one of {', '.join(OFFLOADS)}, not {offload_optimizer!r}"
    if stage not in BACKEND_STAGES[backend]:
        return f"{backend} has stages {', '.join(map(str, BACKEND_STAGES[backend]))}, not {stage}"
    if offload_optimizer != "none" and (backend != "deepspeed" or stage == 0):
        return "offload_optimizer needs backend deepspeed with stage 1, 2 or 3"
    return None


@dataclass(frozen=True)
class Point:
    """One grid point: one trial."""

    backend: str
    stage: int
    micro_batch_size: int
    num_workers: int
    activation_checkpointing: bool = False
    offload_optimizer: str = "none"

    @property
    def name(self) -> str:
        """deepspeed points keep the short names of earlier results (stage1_mb64_w2)."""
        prefix = "" if self.backend == "deepspeed" else f"{self.backend}_"
        suffix = ("_ac" if self.activation_checkpointing else "") + (
            f"_offload{self.offload_optimizer}" if self.offload_optimizer != "none" else ""
        )
        return f"{prefix}stage{self.stage}_mb{self.micro_batch_size}_w{self.num_workers}{suffix}"

    def replace(self, **changes: Any) -> "Point":
        return dataclasses.replace(self, **changes)
