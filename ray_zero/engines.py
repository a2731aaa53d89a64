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
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ray_zero.ds_config import build_ds_config
from ray_zero.model_spec import ModelSpec
from ray_zero.state_bytes import state_bytes

BACKEND_STAGES = {"deepspeed": (0, 1, 2, 3), "torch_zero": (0, 1), "fsdp": (2, 3)}
"""torch_zero: DDP (0) or DDP + ZeroRedundancyOptimizer (1). FSDP2 always shards gradients and optimizer
states; it keeps gathered parameters from forward to backward (2) or reshards them after forward (3)."""
OFFLOADS = ("none", "cpu")
LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


class EngineError(ValueError):
    """An engine cannot be built with these settings (one line)."""


@dataclass(frozen=True)
class EngineSettings:
    backend: str = "deepspeed"
    """deepspeed | torch_zero | fsdp"""
    stage: int = 0
    """ZeRO stage: what is partitioned across ranks (see BACKEND_STAGES for what each engine has)."""
    precision: str = "fp32"
    """Resolved precision: fp16 | bf16 | fp32."""
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    optimizer: str = "AdamW"
    """AdamW or Adam, for every engine."""
    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    reduce_bucket_size: int = 50_000_000
    """DeepSpeed's gradient reduce bucket (elements)."""
    allgather_bucket_size: int = 50_000_000
    """DeepSpeed's stage 1/2 all-gather bucket (elements)."""
    offload_optimizer: str = "none"
    """none | cpu: ZeRO-Offload (DeepSpeed stages 1-3) keeps the fp32 master and Adam's states in host memory."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them."""


def supported(backend: str, stage: int, offload_optimizer: str = "none") -> Optional[str]:
    """Why no engine can run this combination, in one line; None when one can."""
    if backend not in BACKEND_STAGES:
        return f"backend must be one of {', '.join(BACKEND_STAGES)}, not {backend!r}"
    if stage not in BACKEND_STAGES[backend]:
        return f"{backend} has stages {', '.join(map(str, BACKEND_STAGES[backend]))}, not {stage}"
    if offload_optimizer not in OFFLOADS:
        return f"offload_optimizer must be one of {', '.join(OFFLOADS)}, not {offload_optimizer!r}"
    if offload_optimizer != "none" and (backend != "deepspeed" or stage == 0):
        return "offload_optimizer needs backend deepspeed with stage 1, 2 or 3"
    return None


def build_engine(spec: ModelSpec, settings: EngineSettings, device: torch.device) -> "Engine":
    """This rank's engine around `spec.module` (already on `device`); torch.distributed must be up."""
    reason = supported(settings.backend, settings.stage, settings.offload_optimizer)
    if reason:
        raise EngineError(reason)
    if settings.precision not in (*LOW_PRECISION, "fp32"):
        raise EngineError(f"precision must be fp16, bf16 or fp32, not {settings.precision!r}")
    _optimizer_class(settings.optimizer)  # an unknown optimizer fails here, before any engine is built
    if settings.activation_checkpointing and spec.enable_checkpointing is None and not spec.blocks:
        raise EngineError("this model cannot be checkpointed: its spec has neither blocks nor enable_checkpointing")
    if not dist.is_initialized():
        raise EngineError("torch.distributed must be initialised before build_engine")
    if dist.get_world_size() != settings.world_size:
        raise EngineError(f"settings.world_size is {settings.world_size} but torch.distributed has {dist.get_world_size()} ranks")
    spec.module.to(device).train()
    if settings.activation_checkpointing:
        _enable_checkpointing(spec)  # before wrapping: DDP, FSDP2 and DeepSpeed then see the recomputing blocks
    engine = {"deepspeed": DeepSpeedEngine, "torch_zero": TorchZeroEngine, "fsdp": FSDPEngine}[settings.backend]
    return engine(spec, settings, device)


def _optimizer_class(name: str) -> type:
    classes = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    if name.lower() not in classes:
        raise EngineError(f"optimizer must be AdamW or Adam, not {name!r}")
    return classes[name.lower()]


def _optimizer_kwargs(settings: EngineSettings) -> dict[str, Any]:
    return {"lr": settings.lr, "betas": tuple(settings.betas), "eps": settings.eps,
            "weight_decay": settings.weight_decay}


def batch_norms(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module's BatchNorm layers (torch's, SyncBatchNorm and subclasses such as timm's BatchNormAct2d)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


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
        """The optimizer step, once per `gradient_accumulation_steps` micro-batches, after the boundary one."""
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


def deepspeed_config(settings: EngineSettings, module: torch.nn.Module, device: torch.device) -> dict:
    """The DeepSpeed config the engine gives `deepspeed.initialize` for this module, key for key."""
    s = settings
    config = build_ds_config(
        stage=s.stage, micro_batch_size=s.micro_batch_size, gradient_accumulation_steps=s.gradient_accumulation_steps,
        world_size=s.world_size, precision=s.precision, optimizer_type=s.optimizer, lr=s.lr, betas=tuple(s.betas),
        eps=s.eps, weight_decay=s.weight_decay, reduce_bucket_size=s.reduce_bucket_size,
        allgather_bucket_size=s.allgather_bucket_size)
    # DeepSpeed 0.19.8 clips the gradient norm to 1.0 unless told otherwise; the torch engines do not clip:
    # the same optimizer everywhere means no clipping here either.
    config["gradient_clipping"] = 0.0
    if s.precision in LOW_PRECISION and batch_norms(module):
        # DeepSpeed 0.19.8 casts parameters to fp16/bf16 but keeps buffers in their dtype (deepspeedai/
        # DeepSpeed#8066, for RoPE's fp32 inv_freq), so BatchNorm meets half-precision weights and fp32
        # running statistics, which no BatchNorm kernel takes. Its escape hatch, data_types.buffer_dtype,
        # casts buffers too, as DeepSpeed did before (module.half()): set for BatchNorm networks only.
        config["data_types"] = {"buffer_dtype": s.precision}
    if s.offload_optimizer == "cpu":
        # With torch_adam DeepSpeed steps torch's AdamW on the host partition (allowed: its
        # zero_force_ds_cpu_optimizer check is for client optimizers only); pinned pages speed up the copies.
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    return config


class DeepSpeedEngine(Engine):
    """`deepspeed.initialize` with the config's one optimizer (torch's Adam(W): no FusedAdam build)."""

    def __init__(self, spec, settings, device):
        super().__init__(spec, settings, device)
        import deepspeed

        self.config = deepspeed_config(settings, spec.module, device)
        # A copy goes in: self.config stays exactly what was asked for, whatever DeepSpeed does to its argument.
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=spec.module, model_parameters=[p for p in spec.module.parameters() if p.requires_grad],
            config=copy.deepcopy(self.config))
        self.input_dtype = (torch.float16 if self.engine.fp16_enabled() else
                            torch.bfloat16 if self.engine.bfloat16_enabled() else torch.float32)
        self._step_pending = False
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        # DeepSpeed 0.19.8's engine.backward scales the loss for ZeRO optimizers only, while stage 0's fp16
        # optimizers still divide the gradients by the loss scale in step: updates 65536 times too small
        # (measured on an H200; deepspeedai/DeepSpeed#8393, open). Scale it here, on the version measured only.
        self._scale_loss = (deepspeed.__version__ == "0.19.8" and self.engine.fp16_enabled()
                            and not isinstance(self.engine.optimizer, ZeROOptimizer))

    def _forward_backward(self, batch, boundary, forward_context):
        if self.engine.is_gradient_accumulation_boundary() != boundary:
            raise EngineError(f"DeepSpeed counts micro-batches itself: boundary={boundary} at its micro-step "
                              f"{self.engine.micro_steps} with gradient_accumulation_steps "
                              f"{self.settings.gradient_accumulation_steps}")
        with _entered(forward_context):
            loss = self.spec.loss(self.engine, batch)
        # engine.backward divides by gradient_accumulation_steps itself
        self.engine.backward(loss * self.engine.optimizer.loss_scale if self._scale_loss else loss)
        if boundary:
            self._step_pending = True  # the optimizer steps in step(), after the caller has seen the gradients
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
        self.config = dataclasses.asdict(settings)

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

        self.model = DistributedDataParallel(spec.module, device_ids=[device] if device.type == "cuda" else None)
        params = [p for p in spec.module.parameters() if p.requires_grad]
        optimizer_class, kwargs = _optimizer_class(settings.optimizer), _optimizer_kwargs(settings)
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
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype
                    else contextlib.nullcontext())
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
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
        shard = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=settings.stage == 3, mp_policy=policy)
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
        self.optimizer = self.local_optimizer = _optimizer_class(settings.optimizer)(params, **_optimizer_kwargs(settings))
        if settings.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type)  # all ranks agree on inf/NaN before skipping a step

    def _forward_backward(self, batch, boundary, forward_context):
        # Reduce-scatter every micro-batch, as DeepSpeed's ZeRO-2/3 do: skipping it (set_requires_gradient_sync)
        # would keep whole gradients between micro-batches, the memory stages 2 and 3 exist to save.
        with _entered(forward_context):
            loss = self.spec.loss(self.model, batch)
        self._backward(loss)
        return loss.detach()
