"""Three ways of fitting a model in memory behind one small interface: DeepSpeed ZeRO (stages 0-3,
optionally with the optimizer offloaded to the CPU), PyTorch DDP + ZeroRedundancyOptimizer (stages 0-1)
and FSDP2 (stages 2-3).

`build_engine(spec, settings, device)` needs only torch.distributed to be initialised (by Ray Train,
torchrun or a test); every engine trains with the same optimizer, and each rank's `Engine` says what it
holds (`model_state_bytes`). No Ray here; deepspeed is imported inside functions.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from ray_zero.config import unsupported
from ray_zero.models.spec import ModelSpec
from ray_zero.train.ds_config import LOW_PRECISION, batch_norms, deepspeed_config
from ray_zero.train.settings import EngineSettings
from ray_zero.train.state_bytes import state_bytes


class EngineError(ValueError):
    """An engine cannot be built with these settings (one line)."""


def build_engine(spec: ModelSpec, settings: EngineSettings, device: torch.device) -> "Engine":
    """This rank's engine around `spec.module` (already on `device`); torch.distributed must be up."""
    reason = unsupported(settings.backend, settings.stage, settings.offload_optimizer)
    if reason:
        raise EngineError(reason)
    if settings.precision not in (*LOW_PRECISION, "fp32"):
        raise EngineError(f"precision must be fp16, bf16 or fp32, not {settings.precision!r}")
    _optimizer_class(settings.optimizer.type)  # an unknown optimizer fails here, before any engine is built
    if settings.activation_checkpointing and spec.enable_checkpointing is None and not spec.blocks:
        raise EngineError(
            "this model cannot be checkpointed: its spec has neither blocks nor enable_checkpointing"
        )
    if not dist.is_initialized():
        raise EngineError("torch.distributed must be initialised before build_engine")
    if dist.get_world_size() != settings.world_size:
        raise EngineError(
            f"settings.world_size is {settings.world_size} but torch.distributed has {dist.get_world_size()} "
            "ranks"
        )
    spec.module.to(device).train()
    if settings.activation_checkpointing:
        _enable_checkpointing(
            spec
        )  # before wrapping: DDP, FSDP2 and DeepSpeed then see the recomputing blocks
    engine = {"deepspeed": DeepSpeedEngine, "torch_zero": TorchZeroEngine, "fsdp": FSDPEngine}[
        settings.backend
    ]
    return engine(spec, settings, device)


def _optimizer_class(name: str) -> type:
    classes = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    if name.lower() not in classes:
        raise EngineError(f"optimizer must be AdamW or Adam, not {name!r}")
    return classes[name.lower()]


def _optimizer_kwargs(settings: EngineSettings) -> dict[str, Any]:
    o = settings.optimizer
    return {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}


def _enable_checkpointing(spec: ModelSpec) -> None:
    from torch.utils.checkpoint import checkpoint

    if spec.enable_checkpointing is not None:
        spec.enable_checkpointing(spec.module)
        return
    for block in spec.blocks:
        # Wrap `forward`, not the module: the module's own hooks (FSDP2's unshard, DeepSpeed's gather) still
        # run around the recomputing forward, as with torch's checkpoint_wrapper.
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _entered(forward_context: Any):
    """`forward_context` as a context manager: one already, or a callable that makes one (a Meter's probe)."""
    if forward_context is None:
        return contextlib.nullcontext()
    return forward_context if hasattr(forward_context, "__enter__") else forward_context()


class Engine:
    """One rank's training: `forward_backward` for each micro-batch, then `step` once per optimizer step."""

    backend: str
    input_dtype: torch.dtype = torch.float32
    config: dict

    def __init__(self, spec: ModelSpec, settings: EngineSettings, device: torch.device):
        self.spec, self.settings, self.device = spec, settings, device
        self.backend = settings.backend
        self._gradient_bytes_after_backward: Optional[int] = None

    def forward_backward(self, batch: Any, boundary: bool, forward_context: Any = None) -> torch.Tensor:
        """Forward (spec.loss under this engine's autocast; `forward_context` around the forward only), then
        backward scaled for gradient accumulation; gradients are reduced across ranks only at `boundary`
        (FSDP2 and DeepSpeed's ZeRO-2/3 reduce-scatter each micro-batch: that is what keeps them sharded).
        Returns the loss, detached and unscaled."""
        loss = self._forward_backward(batch, boundary, forward_context)
        if boundary and self._gradient_bytes_after_backward is None:
            # Some optimizers free or move gradients in step (zero_grad(set_to_none), DeepSpeed's partitions):
            # the first boundary backward is where a rank holds all its gradients.
            self._gradient_bytes_after_backward = self._state_bytes()["gradient_bytes"]
        return loss

    def step(self) -> None:
        """The optimizer step, once per `gradient_accumulation_steps` micro-batches, after the boundary
        one."""
        raise NotImplementedError

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

    def _forward_backward(self, batch, boundary, forward_context) -> torch.Tensor:
        raise NotImplementedError

    def _state_bytes(self) -> dict[str, int]:
        raise NotImplementedError


class DeepSpeedEngine(Engine):
    """`deepspeed.initialize` with the config's one optimizer (torch's Adam(W): no FusedAdam build)."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        import deepspeed

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
        with _entered(forward_context):
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


class _TorchEngine(Engine):
    """What DDP and FSDP2 share: a torch optimizer over fp32 parameters, a grad scaler for fp16."""

    optimizer: torch.optim.Optimizer
    local_optimizer: torch.optim.Optimizer  # the one that holds this rank's states
    scaler = None

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        self.config = settings.as_dict()

    def _backward(self, loss: torch.Tensor) -> None:
        scaled = loss / self.settings.gradient_accumulation_steps
        (self.scaler.scale(scaled) if self.scaler else scaled).backward()

    def step(self):
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _state_bytes(self):
        # DDP's gradient buckets (one more copy of all gradients, gradient_as_bucket_view=False) live in its
        # C++ reducer, not reachable through public attributes: they are not counted.
        return state_bytes(self.spec.module, self.local_optimizer)


class TorchZeroEngine(_TorchEngine):
    """DDP with AdamW (stage 0) or ZeroRedundancyOptimizer(AdamW) (stage 1), fp32 parameters, autocast.
    Autocast leaves BatchNorm alone: it normalises low-precision activations with its fp32 weights and
    running statistics (DDP broadcasts those from rank 0 at each forward)."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        from torch.nn.parallel import DistributedDataParallel

        self.model = DistributedDataParallel(
            spec.module, device_ids=[device] if device.type == "cuda" else None
        )
        params = [p for p in spec.module.parameters() if p.requires_grad]
        optimizer_class, kwargs = _optimizer_class(settings.optimizer.type), _optimizer_kwargs(settings)
        if settings.stage == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)
            self.local_optimizer = self.optimizer.optim  # over this rank's share of the parameters only
        else:
            self.optimizer = self.local_optimizer = optimizer_class(params, **kwargs)
        self.autocast_dtype = LOW_PRECISION.get(settings.precision)
        if settings.precision == "fp16":
            self.scaler = torch.amp.GradScaler(device.type)

    def _forward_backward(self, batch, boundary, forward_context):
        autocast = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype
            else contextlib.nullcontext()
        )
        # no_sync must hold through backward: that is where DDP's all-reduce runs.
        with contextlib.nullcontext() if boundary else self.model.no_sync():
            with autocast, _entered(forward_context):
                loss = self.spec.loss(self.model, batch)
            self._backward(loss)
        return loss.detach()


class FSDPEngine(_TorchEngine):
    """FSDP2: fully_shard on each block, then the root; one mesh over all ranks."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # Parameters compute in low precision (FSDP2 casts them, and the root's floating inputs); gradients
        # are reduced and kept in fp32, like the sharded fp32 parameters the optimizer steps.
        low = LOW_PRECISION.get(settings.precision)
        policy = (
            MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
            if low
            else MixedPrecisionPolicy()
        )
        shard = functools.partial(
            fully_shard, mesh=mesh, reshard_after_forward=settings.stage == 3, mp_policy=policy
        )
        if low:
            # FSDP2 casts parameters, not buffers: a BatchNorm would meet low-precision weights and fp32
            # running statistics. As FSDP1 did by default and FSDP2's authors advise (pytorch/torchtitan#674),
            # each BatchNorm is its own group computing in fp32; BatchNorm kernels take low-precision inputs
            # with fp32 weights and statistics, and return the inputs' dtype.
            for norm in batch_norms(spec.module):
                shard(norm, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        for block in spec.blocks or ():
            shard(block)
        self.model = shard(spec.module)
        params = [p for p in spec.module.parameters() if p.requires_grad]
        self.optimizer = self.local_optimizer = _optimizer_class(settings.optimizer.type)(
            params, **_optimizer_kwargs(settings)
        )
        if settings.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type)  # all ranks agree on inf/NaN before skipping a step

    def _forward_backward(self, batch, boundary, forward_context):
        # Reduce-scatter every micro-batch, as DeepSpeed's ZeRO-2/3 do: skipping it
        # (set_requires_gradient_sync)
        # would keep whole gradients between micro-batches, the memory stages 2 and 3 exist to save.
        with _entered(forward_context):
            loss = self.spec.loss(self.model, batch)
        self._backward(loss)
        return loss.detach()
