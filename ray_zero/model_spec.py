"""What ray_zero needs to train a model it has never seen: the public protocol of `model:` sources.

A user's factory (`model: my_pkg.models:build` or `model: path/to/file.py:build`) returns either a plain
`nn.Module` (a classifier: ray_zero then needs `input_shape` and `num_classes` in the experiment) or a
`ModelSpec`, which also says how to make a batch and what the loss is. Every source ray_zero knows
(presets, `hf:`, `timm:`) is turned into a ModelSpec too, so that the training loop and every engine
(DeepSpeed, DDP + ZeroRedundancyOptimizer, FSDP2) see one shape of model. No Ray, no DeepSpeed here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

Batch = Any
"""A tensor, or a tuple / list / dict of tensors: whatever `loss` takes."""


@dataclass
class ModelSpec:
    """A model and how to train it on synthetic data."""

    module: nn.Module
    """The model, built on the CPU with real (random) weights; ray_zero moves it to the rank's device."""
    make_batch: Callable[[int, torch.device, torch.Generator], Batch]
    """`make_batch(n, device, generator)`: n samples on `device`, drawn with `generator` (seeded by ray_zero
    from the experiment's seed and the rank). Floating-point tensors are cast to the engine's input dtype."""
    loss: Callable[[Callable[..., Any], Batch], torch.Tensor]
    """`loss(model, batch)`: the scalar training loss. `model` is what the engine made of `module` (a
    DeepSpeed engine, a DDP wrapper or the FSDP2-sharded module itself): call it, don't reach inside it."""
    blocks: Optional[Sequence[nn.Module]] = None
    """The repeated layers (transformer blocks): FSDP2 shards each of them, activation checkpointing
    recomputes each. None: the module is treated as one block."""
    enable_checkpointing: Optional[Callable[[nn.Module], None]] = None
    """Turns activation checkpointing on for `module` (in place). None: ray_zero wraps each of `blocks`
    with torch.utils.checkpoint; a spec without blocks cannot be checkpointed."""


def cast_floating(batch: Batch, dtype: torch.dtype) -> Batch:
    """The batch with its floating-point tensors in `dtype` (DeepSpeed's fp16/bf16 engines do not
    autocast: their inputs must already be in the engine's dtype); integer tensors (token ids, labels)
    as they are."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {key: cast_floating(value, dtype) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(cast_floating(value, dtype) for value in batch)
    return batch


def batch_bytes(batch: Batch) -> int:
    """Bytes of the tensors in a batch."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(batch_bytes(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(value) for value in batch)
    return 0
