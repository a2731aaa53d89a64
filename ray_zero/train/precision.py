"""Floating buffers beside half-precision parameters: which ones go to fp16/bf16 with the weights.

DeepSpeed 0.19.8 casts parameters, not buffers, to fp16/bf16 (deepspeedai/DeepSpeed#8066: RoPE's fp32
inv_freq), and FSDP2's MixedPrecisionPolicy casts parameters only. A module that computes a buffer with
its weights then mixes dtypes: timm's Swin adds its fp32 attention mask to bf16 attention scores, the sum
is promoted to fp32 and the next matmul with bf16 values fails, "expected scalar type Float but found
BFloat16". PyTorch DDP (torch_zero) needs nothing: its parameters and buffers stay fp32 under autocast.

`cast_float_buffers` casts a floating buffer to the compute dtype when the module that holds it has
parameters (its own or its children's: the module computes the buffer with its weights), or when the buffer
is a matrix or a kernel (two or more dimensions) that a module without weights applies to the activations
as one (timm's BlurPool filter and CSATv2's DCT basis go to F.conv2d and F.linear, which take one dtype),
except:

- a vector in a module with no parameters anywhere in it (a rotary embedding's inv_freq): a table the
  module computes from in fp32 by its own code (Transformers' rotary embeddings upcast it and cast their
  result), as DeepSpeed 0.19.8 keeps it; elementwise use promotes rather than fails;
- buffers the model names for fp32 (Transformers' `_keep_in_fp32_modules_strict`, and under fp16
  `_keep_in_fp32_modules`: DeepSeek-V3's routing bias), matched as DeepSpeed and Transformers match them;
- a norm's running statistics (BatchNorm, InstanceNorm) when `keep_norms`: FSDP2 computes each BatchNorm
  in fp32 (its own group) and DeepSpeed casts a BatchNorm network's buffers itself (ds_config.py).

torch only: no DeepSpeed import.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The compute dtype of each half precision (ds_config.LOW_PRECISION's, which imports this module's user)."""


def kept_in_fp32(module: nn.Module, dtype: torch.dtype) -> Optional[re.Pattern]:
    """The model's own names of tensors to keep in fp32 at `dtype`, as one pattern over full buffer names
    (deepspeed/runtime/keep_in_fp32.py's rule, Transformers' glob: `*` any characters, found anywhere);
    None when it names none."""
    patterns = set()
    for prefix, child in module.named_modules():
        names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
        for name in names:
            pattern = name.replace("*", ".*")
            patterns.add(rf"^{re.escape(prefix)}\..*{pattern}" if prefix else pattern)
    return re.compile("|".join(sorted(patterns))) if patterns else None


def buffers_to_cast(module: nn.Module, dtype: torch.dtype, keep_norms: bool = True) -> list[str]:
    """The full names of the floating buffers `cast_float_buffers` casts to `dtype` (none for fp32)."""
    if dtype not in LOW.values():
        return []
    keep = kept_in_fp32(module, dtype)
    names = []
    for prefix, owner in module.named_modules():
        if keep_norms and isinstance(owner, _NormBase):
            continue
        weightless = next(owner.parameters(), None) is None
        for name, buffer in owner.named_buffers(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if buffer is None or not buffer.is_floating_point() or buffer.dtype == dtype:
                continue
            if weightless and buffer.dim() < 2:  # a table the module computes from itself
                continue
            if keep is not None and keep.search(full):
                continue
            names.append(full)
    return names


def cast_float_buffers(module: nn.Module, precision: str, keep_norms: bool = True) -> list[str]:
    """Cast in place, to `precision`'s compute dtype ("fp16", "bf16"), the floating buffers `module`
    computes with its weights (the rule is the module docstring's); returns their names. Nothing for fp32."""
    dtype = LOW.get(precision)
    if dtype is None:
        return []
    names = buffers_to_cast(module, dtype, keep_norms)
    for name in names:
        owner_name, _, attribute = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        buffer = getattr(owner, attribute)
        buffer.data = buffer.data.to(dtype)  # .data: the buffer stays the same object (hooks, aliases)
    return names
