"""An engine's settings: the trial's point and the experiment's sections as they are (the optimizer
section whole), read by every engine and by DeepSpeed's config. Pure: no DeepSpeed here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_zero.config import DEFAULT_BUCKET_ELEMENTS, Optimizer, TrialSpec


@dataclass(frozen=True)
class EngineSettings:
    backend: str = "deepspeed"
    """deepspeed | torch_zero | fsdp (config.BACKEND_STAGES: the stages each has)."""
    stage: int = 0
    """ZeRO stage: what is partitioned across ranks."""
    precision: str = "fp32"
    """Resolved precision: fp16 | bf16 | fp32."""
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    optimizer: Optimizer = field(default_factory=Optimizer)
    """The experiment's optimizer section, the same for every engine."""
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    """DeepSpeed's gradient reduce bucket (elements)."""
    allgather_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    """DeepSpeed's stage 1/2 all-gather bucket (elements)."""
    offload_optimizer: str = "none"
    """none | cpu: ZeRO-Offload (DeepSpeed stages 1-3) keeps the fp32 master and Adam's states in host
    memory."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them."""
    unreached_params: bool = False
    """The loss reaches only some of the trainable parameters (the model's one-sample count: a vision
    tower beside text inputs): DDP must look for the unused ones each step."""

    @classmethod
    def for_trial(cls, spec: TrialSpec, world_size: int) -> "EngineSettings":
        """A trial's point and its experiment's sections, as every rank builds them."""
        e, point = spec.experiment, spec.point.fields()
        del point["num_workers"]  # the ranks torch.distributed has: world_size
        del point["seq_len"]  # the batches' length: the model's (its make_batch), not the engine's
        return cls(
            **point,
            precision=spec.precision,
            gradient_accumulation_steps=e.gradient_accumulation_steps,
            world_size=world_size,
            optimizer=e.optimizer,
            reduce_bucket_size=e.reduce_bucket_size,
            allgather_bucket_size=e.allgather_bucket_size,
            unreached_params=bool(getattr(spec.model, "unreached_params", ())),
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data (the torch engines' `config`, as DeepSpeed's is its dict)."""
        return {**self.__dict__, "optimizer": self.optimizer.model_dump()}
