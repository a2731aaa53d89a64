"""What ray_zero needs to train a model it has never seen: the public protocol of `model:` sources.

A user's factory (`model: my_pkg.models:build` or `model: path/to/file.py:build`) returns either a plain
`nn.Module` (a classifier: ray_zero then needs `input_shape` and `num_classes` in the experiment) or a
`ModelSpec`, which also says how to make a batch and what the loss is. Every source ray_zero knows
(presets, `hf:`, `timm:`) is turned into a ModelSpec too, so that the training loop and every engine
(DeepSpeed, DDP + ZeroRedundancyOptimizer, FSDP2) see one shape of model. No Ray, no DeepSpeed here.
"""

from __future__ import annotations

import copy
import functools
import types
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


SYNTHETIC_BATCHES = 4
"""Synthetic micro-batches a rank makes once on its device and serves in turn (ray_zero/train/worker.py)."""


def batch_bytes(batch: Batch) -> int:
    """Bytes of the tensors in a batch."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(batch_bytes(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(value) for value in batch)
    return 0


def copied(spec: ModelSpec) -> ModelSpec:
    """A deep copy of `spec`, its functions included, for a rank that trains the same model again (fit's
    probes on a GPU): a function's closure, a partial's arguments, a bound method's object or a callable
    object's state that refer to the module or its blocks (a checkpointing function wraps the blocks it
    was given) refer to the copy's. Raises what copy.deepcopy raises for what cannot be copied."""
    memo: dict[int, Any] = {}
    module = copy.deepcopy(spec.module, memo)
    blocks = [copy.deepcopy(block, memo) for block in spec.blocks] if spec.blocks is not None else None
    return ModelSpec(
        module,
        _copied(spec.make_batch, memo),
        _copied(spec.loss, memo),
        blocks,
        _copied(spec.enable_checkpointing, memo),
    )


def _copied(value: Any, memo: dict[int, Any]) -> Any:
    if id(value) in memo:
        return memo[id(value)]
    if value is None or isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)):
        return value  # shared: nothing of the model inside
    if isinstance(value, functools.partial):
        made = functools.partial(
            _copied(value.func, memo),
            *(_copied(a, memo) for a in value.args),
            **{k: _copied(v, memo) for k, v in value.keywords.items()},
        )
    elif isinstance(value, types.FunctionType):
        if not (value.__closure__ or value.__defaults__ or value.__kwdefaults__):
            return value  # what it refers to is global: shared
        made = types.FunctionType(
            value.__code__,
            value.__globals__,
            value.__name__,
            None,
            tuple(types.CellType() for _ in value.__closure__ or ()),
        )
        memo[id(value)] = made  # before its cells: a function may refer to itself
        for cell, original in zip(made.__closure__ or (), value.__closure__ or ()):
            try:
                cell.cell_contents = _copied(original.cell_contents, memo)
            except ValueError:  # an empty cell (a name assigned after the function was made)
                pass
        made.__defaults__ = (
            tuple(_copied(d, memo) for d in value.__defaults__) if value.__defaults__ else None
        )
        made.__kwdefaults__ = (
            {k: _copied(v, memo) for k, v in value.__kwdefaults__.items()} if value.__kwdefaults__ else None
        )
        made.__qualname__, made.__dict__ = value.__qualname__, dict(value.__dict__)
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        made = type(value)(_copied(item, memo) for item in value)
    elif isinstance(value, dict):
        made = {k: _copied(v, memo) for k, v in value.items()}
    else:  # a module, a tensor, a bound method (its object copied), a callable object, a number
        return copy.deepcopy(value, memo)
    memo[id(value)] = made
    return made
