"""build_engine: this rank's engine, chosen by the settings' backend, among three ways of fitting a model in
memory: DeepSpeed ZeRO (stages 0-3, optionally with the optimizer offloaded to the CPU), PyTorch DDP +
ZeroRedundancyOptimizer (stages 0-1) and FSDP2 (stages 2-3).

`build_engine(spec, settings, device)` needs only torch.distributed to be initialised (by Ray Train,
torchrun or a test); every engine trains with the same optimizer, and each rank's `Engine` says what it
holds (`model_state_bytes`). No Ray here; deepspeed is imported inside DeepSpeedEngine's methods. The
interface: ray_zero/train/engine_base.py; the engines: deepspeed_engine.py and torch_engines.py.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ray_zero.config import registered, unsupported
from ray_zero.models.spec import ModelSpec
from ray_zero.train.deepspeed_engine import DeepSpeedEngine
from ray_zero.train.ds_config import LOW_PRECISION
from ray_zero.train.engine_base import Engine, EngineError, optimizer_class
from ray_zero.train.settings import EngineSettings
from ray_zero.train.torch_engines import FSDPEngine, TorchZeroEngine


def build_engine(spec: ModelSpec, settings: EngineSettings, device: torch.device) -> Engine:
    """This rank's engine around `spec.module` (already on `device`); torch.distributed must be up."""
    reason = unsupported(settings.backend, settings.stage, settings.offload_optimizer)
    if reason:
        raise EngineError(reason)
    if settings.precision not in (*LOW_PRECISION, "fp32"):
        raise EngineError(f"precision must be fp16, bf16 or fp32, not {settings.precision!r}")
    optimizer_class(settings.optimizer.type)  # an unknown optimizer fails here, before any engine is built
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
        # Before wrapping: DDP, FSDP2 and DeepSpeed then see the recomputing blocks.
        _enable_checkpointing(spec)
    return ENGINE_CLASSES[settings.backend](spec, settings, device)


ENGINE_CLASSES = registered(
    {"deepspeed": DeepSpeedEngine, "torch_zero": TorchZeroEngine, "fsdp": FSDPEngine},
    "engine classes (ray_zero/train/engines.py)",
)


def _enable_checkpointing(spec: ModelSpec) -> None:
    if spec.enable_checkpointing is not None:
        spec.enable_checkpointing(spec.module)
        return
    for block in spec.blocks:
        # Wrap `forward`, not the module: the module's own hooks (FSDP2's unshard, DeepSpeed's gather) still
        # run around the recomputing forward, as with torch's checkpoint_wrapper.
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
