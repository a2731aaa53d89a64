"""Prediction: the bytes a formula predicts on one rank, by component, and the peak they add up to.

The formulas that fill it: ray_zero/measure/engine_memory.py (model states, per engine and the ZeRO
paper's) and ray_zero/measure/memory_model.py (a results row's activations, workspace and data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GIB = 1024**3
BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class Prediction:
    """Predicted bytes on one rank, per component."""

    formula: str
    parameter_bytes: float
    gradient_bytes: float
    master_param_bytes: float
    optimizer_state_bytes: float
    bucket_bytes: float = 0.0
    """Communication buffers: ZeRO's reduce bucket (allocated at its configured size whatever the model),
    DDP's gradient buckets."""
    step_transient_bytes: float = 0.0
    """Temporaries that live only inside the optimizer step (e.g. fp32 copies of gradients)."""
    compute_bytes: float = 0.0
    """Parameters gathered or cast for compute while activations live: FSDP2's unsharded blocks,
    autocast's low-precision weight copies."""
    activation_bytes: Optional[float] = 0.0
    """Tensors saved for backward for one micro-batch; None when unknown (no calibration)."""
    workspace_bytes: float = 0.0
    data_bytes: float = 0.0
    """This rank's data on the device (MNIST shard or synthetic batches)."""
    gradients_freed_in_step: bool = False
    """The optimizer frees the gradients after its step (zero_grad(set_to_none), DeepSpeed's stages 0-2),
    so they are not allocated while the next forward's activations peak: DeepSpeed stages 0-2, DDP and
    FSDP2 (each phase's memory: per_rank.csv of the GPU folders under results/); ZeRO-3 allocates its
    gradient partition once, at initialize."""
    basis: str = "unchecked"
    """On what this formula was checked."""

    @property
    def model_state_bytes(self) -> float:
        return (
            self.parameter_bytes + self.gradient_bytes + self.master_param_bytes + self.optimizer_state_bytes
        )

    @property
    def peak_bytes(self) -> Optional[float]:
        if self.activation_bytes is None:
            return None
        # Activations peak at the end of the forward (before the gradients where the step freed them) and
        # are freed by the end of backward; the step's temporaries come after.
        forward = (
            self.activation_bytes
            + self.compute_bytes
            - (self.gradient_bytes if self.gradients_freed_in_step else 0.0)
        )
        return (
            self.model_state_bytes
            + self.bucket_bytes
            + self.workspace_bytes
            + self.data_bytes
            + max(forward, self.step_transient_bytes)
        )
