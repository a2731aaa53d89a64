"""DeepSpeedEngine: DeepSpeed ZeRO (stages 0-3, optionally with the optimizer offloaded to the CPU).

deepspeed is imported inside its methods: importing this module does not import DeepSpeed.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch

from ray_zero.train.ds_config import deepspeed_config
from ray_zero.train.engine_base import Engine, EngineError
from ray_zero.train.precision import cast_float_buffers
from ray_zero.train.state_bytes import state_bytes


def skip_inference_all_reduce_build() -> None:
    """On CPU, DeepSpeed's communication backend JIT-builds its shared-memory all-reduce at the first
    initialize (deepspeed_shm_comm: 38-62 s of C++ on 2 cores in a fresh environment, 0.3 s once cached).
    Only its tensor-parallel layers call it (`inference_all_reduce`), never ZeRO. Marked incompatible,
    as on a machine without a compiler, the backend skips the build; training's collectives stay gloo's."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


CHECKED_LOSS_SCALE_BUG = "0.19.8"
"""The DeepSpeed version on which the stage-0 fp16 loss-scale bug (deepspeedai/DeepSpeed#8393) was
measured and its fix checked (an H200: without it, updates 65536 times too small)."""


def loss_scale_fix(engine) -> tuple[bool, Optional[str]]:
    """Whether ray_zero scales the loss itself, and what the rank reports of it (None: not concerned).

    DeepSpeed 0.19.8's engine.backward scales the loss for ZeRO optimizers only, while stage 0's fp16
    optimizer (FP16_Optimizer) still divides the gradients by its loss scale in step. Where that path is
    taken (an fp16 engine whose optimizer keeps a loss scale, is no ZeRO optimizer and gets no torch
    GradScaler from the engine), the fix applies on the version it was checked on. On any other version
    it does not (scaling twice, were DeepSpeed to scale the loss itself, would be as wrong as not at all):
    a warning and the rank's report name the version, so a loss that does not fall is explained."""
    import deepspeed
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = engine.optimizer
    cause = (
        engine.fp16_enabled()
        and not isinstance(optimizer, ZeROOptimizer)
        and hasattr(optimizer, "loss_scale")
        and not getattr(engine, "torch_autocast_z0_gradscaler", None)
    )
    if not cause:
        return False, None
    if deepspeed.__version__ == CHECKED_LOSS_SCALE_BUG:
        return True, f"applied (checked on DeepSpeed {CHECKED_LOSS_SCALE_BUG})"
    reason = (
        f"not applied: fp16 stage 0's loss scaling (deepspeedai/DeepSpeed#8393) was checked on DeepSpeed "
        f"{CHECKED_LOSS_SCALE_BUG}, this is {deepspeed.__version__}: if the loss does not fall, that is why"
    )
    warnings.warn(reason, stacklevel=2)
    return False, reason


class DeepSpeedEngine(Engine):
    """`deepspeed.initialize` with the config's one optimizer (torch's Adam(W): no FusedAdam build)."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        import deepspeed

        if device.type == "cpu":
            skip_inference_all_reduce_build()
        # DeepSpeed casts parameters, not buffers: those the module computes with its weights go with them
        # (a norm's statistics too: its weights are half precision here), ray_zero/train/precision.py.
        cast_float_buffers(spec.module, settings.precision, keep_norms=False)
        self.config = deepspeed_config(settings, spec.module, device)
        # A copy goes in: self.config stays exactly what was asked for, whatever DeepSpeed does to its
        # argument.
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=spec.module,
            model_parameters=[p for p in spec.module.parameters() if p.requires_grad],
            config=copy.deepcopy(self.config),
        )
        self.input_dtype = (
            torch.float16
            if self.engine.fp16_enabled()
            else torch.bfloat16
            if self.engine.bfloat16_enabled()
            else torch.float32
        )
        self._step_pending = False
        self._scale_loss, self.loss_scale_fix = loss_scale_fix(self.engine)

    def _forward(self, batch, boundary):
        if self.engine.is_gradient_accumulation_boundary() != boundary:
            raise EngineError(
                f"DeepSpeed counts micro-batches itself: boundary={boundary} at its micro-step "
                f"{self.engine.micro_steps} with gradient_accumulation_steps "
                f"{self.settings.gradient_accumulation_steps}"
            )
        return self.spec.loss(self.engine, batch)

    def _backward(self, loss, boundary):
        # engine.backward divides by gradient_accumulation_steps itself
        self.engine.backward(loss * self.engine.optimizer.loss_scale if self._scale_loss else loss)
        if boundary:
            self._step_pending = True  # the optimizer steps in step(), once the caller has seen the gradients
        else:
            self.engine.step()  # DeepSpeed counts micro-batches in step(); off the boundary it only counts

    def _step(self):
        if not self._step_pending:
            raise EngineError("step() before the boundary micro-batch's forward_backward")
        self.engine.step()
        self._step_pending = False

    def _state_bytes(self):
        return state_bytes(self.engine.module, self.optimizer)

    def close(self):
        # DeepSpeed's ZeRO optimizers hook every parameter's gradient accumulator, a reference cycle through
        # C++ that the garbage collector cannot see: without destroy() each engine stayed allocated after
        # its rank returned (on an H200, 14 GiB after a 1.1 B model's ZeRO-3 run).
        module = self.engine.module
        self.engine.destroy()
        if self.settings.stage == 3:
            # ZeRO-3 (0.19.8) also keeps the module on a module-level stack, and in closures of autograd
            # Functions it defines per submodule, which destroy() leaves; each parameter refers to the
            # optimizer (`_z3_optimizer`) and holds its partition (`ds_tensor`). Cut those references.
            from deepspeed.runtime.zero import parameter_offload

            stack = parameter_offload.FWD_MODULE_STACK
            stack[:] = [m for m in stack if m is not module]
            for param in module.parameters():
                vars(param).clear()
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            for submodule in module.modules():  # the hooks ZeRO-3 registered close over its engine
                for name, hooks in vars(submodule).items():
                    if "hooks" in name and isinstance(hooks, dict):
                        hooks.clear()
