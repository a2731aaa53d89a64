"""DeepSpeedEngine: DeepSpeed ZeRO (stages 0-3, optionally with the optimizer offloaded to the CPU).

deepspeed is imported inside its methods: importing this module does not import DeepSpeed.
"""

from __future__ import annotations

import copy

import torch

from ray_zero.train.ds_config import deepspeed_config
from ray_zero.train.engine_base import Engine, EngineError, entered
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


class DeepSpeedEngine(Engine):
    """`deepspeed.initialize` with the config's one optimizer (torch's Adam(W): no FusedAdam build)."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        import deepspeed

        if device.type == "cpu":
            skip_inference_all_reduce_build()
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
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        # DeepSpeed 0.19.8's engine.backward scales the loss for ZeRO optimizers only, while stage 0's fp16
        # optimizers still divide the gradients by the loss scale in step: updates 65536 times too small
        # (measured on an H200; deepspeedai/DeepSpeed#8393, open). Scale it here, on the version measured
        # only.
        self._scale_loss = (
            deepspeed.__version__ == "0.19.8"
            and self.engine.fp16_enabled()
            and not isinstance(self.engine.optimizer, ZeROOptimizer)
        )

    def _forward_backward(self, batch, boundary, forward_context):
        if self.engine.is_gradient_accumulation_boundary() != boundary:
            raise EngineError(
                f"DeepSpeed counts micro-batches itself: boundary={boundary} at its micro-step "
                f"{self.engine.micro_steps} with gradient_accumulation_steps "
                f"{self.settings.gradient_accumulation_steps}"
            )
        with entered(forward_context):
            loss = self.spec.loss(self.engine, batch)
        # engine.backward divides by gradient_accumulation_steps itself
        self.engine.backward(loss * self.engine.optimizer.loss_scale if self._scale_loss else loss)
        if boundary:
            self._step_pending = (
                True  # the optimizer steps in step(), after the caller has seen the gradients
            )
        else:
            self.engine.step()  # DeepSpeed counts micro-batches in step(); off the boundary it only counts
        return loss.detach()

    def step(self):
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
