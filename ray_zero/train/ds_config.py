"""The DeepSpeed config of one trial, from its EngineSettings, key for key what deepspeed.initialize gets.
No I/O and no DeepSpeed import: `build_ds_config` is plain data, `deepspeed_config` adds what the module
itself asks for (BatchNorm buffers) and where the optimizer lives."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ray_zero.train.settings import EngineSettings

PRECISIONS = ("fp16", "bf16", "fp32")
LOW_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build_ds_config(settings: EngineSettings) -> dict[str, Any]:
    """DeepSpeed config with exactly one optimizer, the experiment's (no client optimizer is passed to
    initialize). `settings.precision` must already be resolved (Experiment.resolved_precision)."""
    s = settings
    if s.stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {s.stage!r}")
    if s.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {s.precision!r}")
    for name in ("micro_batch_size", "gradient_accumulation_steps", "world_size"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(s, name)!r}")

    zero: dict[str, Any] = {"stage": s.stage, "reduce_bucket_size": int(s.reduce_bucket_size)}
    if s.stage in (1, 2):
        zero["allgather_bucket_size"] = int(s.allgather_bucket_size)
    o = s.optimizer
    config: dict[str, Any] = {
        "train_batch_size": s.micro_batch_size * s.gradient_accumulation_steps * s.world_size,
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "optimizer": {
            "type": o.type,
            # torch_adam: use torch's Adam(W) rather than JIT-compiling FusedAdam; same on CPU and GPU.
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "torch_adam": True,
            },
        },
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,  # ray_zero reports its own metrics; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    if s.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif s.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def batch_norms(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module's BatchNorm layers (torch's, SyncBatchNorm and subclasses such as timm's BatchNormAct2d)."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


def deepspeed_config(settings: EngineSettings, module: torch.nn.Module, device: torch.device) -> dict:
    """The DeepSpeed config the engine gives `deepspeed.initialize` for this module, key for key."""
    config = build_ds_config(settings)
    # DeepSpeed 0.19.8 clips the gradient norm to 1.0 unless told otherwise; the torch engines do not clip:
    # the same optimizer everywhere means no clipping here either.
    config["gradient_clipping"] = 0.0
    if settings.precision in LOW_PRECISION and batch_norms(module):
        # DeepSpeed 0.19.8 casts parameters to fp16/bf16 but keeps buffers in their dtype (deepspeedai/
        # DeepSpeed#8066, for RoPE's fp32 inv_freq), so BatchNorm meets half-precision weights and fp32
        # running statistics, which no BatchNorm kernel takes. Its escape hatch, data_types.buffer_dtype,
        # casts buffers too, as DeepSpeed did before (module.half()): set for BatchNorm networks only.
        config["data_types"] = {"buffer_dtype": settings.precision}
    if settings.offload_optimizer == "cpu":
        # With torch_adam DeepSpeed steps torch's AdamW on the host partition (allowed: its
        # zero_force_ds_cpu_optimizer check is for client optimizers only); pinned pages speed up the copies.
        config["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu",
            "pin_memory": device.type == "cuda",
        }
    return config
