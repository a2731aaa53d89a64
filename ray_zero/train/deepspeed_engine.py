"""DeepSpeedEngine: DeepSpeed ZeRO (stages 0-3, optionally with the optimizer offloaded to the CPU).

deepspeed is imported inside its methods: importing this module does not import DeepSpeed.
"""

from __future__ import annotations

import copy

import torch

from ray_zero.train import ds_compat
from ray_zero.train.ds_config import deepspeed_config
from ray_zero.train.engine_base import Engine, EngineError
from ray_zero.train.precision import cast_float_buffers
from ray_zero.train.state_bytes import state_bytes


class DeepSpeedEngine(Engine):
    """`deepspeed.initialize` with the config's one optimizer (torch's Adam(W): no FusedAdam build)."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        import deepspeed

        if device.type == "cpu":
            ds_compat.skip_shm_comm_build()
        ds_compat.import_muon_uncompiled()
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
        self._scale_loss, self.loss_scale_fix = ds_compat.loss_scale_fix(self.engine, device)

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
        ds_compat.destroy(self.engine)
        if self.settings.stage == 3:
            # ZeRO-3 also keeps the module on a module-level stack, and in closures of autograd Functions it
            # defines per submodule, which destroy() leaves; each parameter refers to the optimizer and holds
            # its partition (ray_zero/train/ds_compat.py cuts those references).
            ds_compat.release_zero3_module(module)
