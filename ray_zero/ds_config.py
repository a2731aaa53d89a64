"""Build the DeepSpeed config dict for one trial. Pure: no I/O, no DeepSpeed import."""
from __future__ import annotations

from typing import Any

PRECISIONS = ("fp16", "bf16", "fp32")


def build_ds_config(
    *,
    stage: int,
    micro_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    precision: str,
    optimizer_type: str = "AdamW",
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    reduce_bucket_size: int = 50_000_000,
    allgather_bucket_size: int = 50_000_000,
) -> dict[str, Any]:
    """DeepSpeed config with exactly one optimizer (no client optimizer is passed to initialize).

    `precision` must already be resolved (fp16, bf16 or fp32; see Experiment.resolved_precision).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    for name, value in (("micro_batch_size", micro_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps),
                        ("world_size", world_size)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value!r}")

    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": int(reduce_bucket_size)}
    if stage in (1, 2):
        zero["allgather_bucket_size"] = int(allgather_bucket_size)
    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "optimizer": {
            "type": optimizer_type,
            # torch_adam: use torch's Adam(W) rather than JIT-compiling FusedAdam; same on CPU and GPU.
            "params": {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay,
                       "torch_adam": True},
        },
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,  # ray_zero reports its own metrics; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config
