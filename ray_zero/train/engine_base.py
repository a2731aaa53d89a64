"""Engine: one rank's training behind one small interface (forward_backward, step, model_state_bytes,
reducer_bytes, close), EngineError, and what every engine builds the same way (the optimizer, the
forward's context).

The engines themselves: ray_zero/train/deepspeed_engine.py and ray_zero/train/torch_engines.py;
ray_zero/train/engines.py's build_engine picks one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ray_zero.models.spec import ModelSpec
from ray_zero.train.settings import EngineSettings


class EngineError(ValueError):
    """An engine cannot be built with these settings (one line)."""


def optimizer_class(name: str) -> type:
    classes = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    if name.lower() not in classes:
        raise EngineError(f"optimizer must be AdamW or Adam, not {name!r}")
    return classes[name.lower()]


def optimizer_kwargs(settings: EngineSettings) -> dict[str, Any]:
    o = settings.optimizer
    return {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}


def entered(forward_context: Any):
    """`forward_context` as a context manager: one already, or a callable that makes one (a Meter's probe)."""
    if forward_context is None:
        return contextlib.nullcontext()
    return forward_context if hasattr(forward_context, "__enter__") else forward_context()


class Engine:
    """One rank's training: `forward_backward` for each micro-batch, then `step` once per optimizer step."""

    backend: str
    input_dtype: torch.dtype = torch.float32
    config: dict
    loss_scale_fix: Optional[str] = None
    """What the engine does about a known bug in its loss scaling, for the rank's report (DeepSpeed fp16
    stage 0, ray_zero/train/deepspeed_engine.py); None where none applies."""

    def __init__(self, spec: ModelSpec, settings: EngineSettings, device: torch.device):
        self.spec, self.settings, self.device = spec, settings, device
        self.backend = settings.backend
        self._gradient_bytes_after_backward: Optional[int] = None
        self.clock = None
        """The step's clock (ray_zero/train/step_clock.py) while the timed steps run, else None."""

    def forward_backward(self, batch: Any, boundary: bool, forward_context: Any = None) -> torch.Tensor:
        """Forward (spec.loss under this engine's autocast; `forward_context` around the forward only), then
        backward scaled for gradient accumulation; gradients are reduced across ranks only at `boundary`
        (FSDP2 and DeepSpeed's ZeRO-2/3 reduce-scatter each micro-batch: that is what keeps them sharded).
        Returns the loss, detached and unscaled. The step's clock (`clock`, when set) is told where the
        forward and the backward end."""
        with self._micro_batch(boundary):
            with entered(forward_context):
                loss = self._forward(batch, boundary)
            if self.clock is not None:
                self.clock.mark("forward")
            self._backward(loss, boundary)
            if self.clock is not None:
                self.clock.mark("backward")
        loss = loss.detach()
        if boundary and self._gradient_bytes_after_backward is None:
            # Some optimizers free or move gradients in step (zero_grad(set_to_none), DeepSpeed's partitions):
            # the first boundary backward is where a rank holds all its gradients.
            self._gradient_bytes_after_backward = self._state_bytes()["gradient_bytes"]
        return loss

    def step(self) -> None:
        """The optimizer step, once per `gradient_accumulation_steps` micro-batches, after the boundary
        one."""
        self._step()
        if self.clock is not None:
            self.clock.mark("optimizer")

    def reducer_bytes(self) -> dict[str, int]:
        """Bytes by kind of collective that one optimizer step sends outside torch.distributed's Python
        functions (DDP's C++ reducer), which ray_zero/train/comm.py cannot see: none by default."""
        return {}

    def close(self) -> None:
        """Let go of what the engine holds, so that a rank can train another engine after it in the same
        process (fit's probes, the zoo): nothing by default."""

    def model_state_bytes(self) -> dict[str, int]:
        """parameter_bytes, gradient_bytes, master_param_bytes, optimizer_state_bytes, other_optimizer_bytes:
        bytes this rank holds (in device or host memory), each storage once, sharded tensors by their local
        shard. gradient_bytes is the larger of now and after the first boundary backward."""
        states = self._state_bytes()
        states["gradient_bytes"] = max(states["gradient_bytes"], self._gradient_bytes_after_backward or 0)
        return states

    def _micro_batch(self, boundary: bool):
        """Around one micro-batch's forward and backward (DDP's no_sync off the boundary)."""
        return contextlib.nullcontext()

    def _forward(self, batch, boundary: bool) -> torch.Tensor:
        """The loss of `batch` (spec.loss through the engine's model, under its autocast)."""
        raise NotImplementedError

    def _backward(self, loss: torch.Tensor, boundary: bool) -> None:
        raise NotImplementedError

    def _step(self) -> None:
        raise NotImplementedError

    def _state_bytes(self) -> dict[str, int]:
        raise NotImplementedError
