"""Each operator of a traced step costed as the GPU kernel it launches: its kind, its FLOPs (torch's own
formulas, torch.utils.flop_counter's registry), the bytes it reads and writes, its dtype; summed in
buckets of alike operators (kind, dtype, size within a factor of 2) for measure/step_time.py. torch only.

* matmul, attention and conv: the operators torch's FLOP counter has a formula for;
* random fills (dropout's mask): random, by bytes;
* views and allocations launch no kernel and are left out;
* every other operator is elementwise, or a reduction where its largest output is smaller than its
  largest input. Bytes: every tensor argument and output once, at its own size (an embedding's whole
  table counts, though a lookup reads only its rows).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.flop_counter import flop_registry

from ray_zero.measure.step_time import OpCost

aten = torch.ops.aten
MATMUL = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
CONV = {
    aten.convolution, aten._convolution, aten.cudnn_convolution, aten.convolution_overrideable,
    aten._slow_conv2d_forward, aten.convolution_backward,
}  # fmt: skip
RANDOM = {
    aten.bernoulli, aten.bernoulli_, aten.native_dropout, aten.uniform_, aten.normal_, aten.rand,
    aten.rand_like, aten.randn, aten.randn_like,
}  # fmt: skip
"""Operators that draw random numbers (dropout's mask): a kernel class of their own in the profile."""
NO_KERNEL = {
    aten._unsafe_view, aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
    aten.new_empty_strided, aten.lift_fresh, aten._local_scalar_dense,
}  # fmt: skip
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def kind_of(func) -> Optional[str]:
    """matmul, attention, conv, random or pointwise (elementwise or reduction, told apart by the shapes);
    None for an operator that launches no kernel."""
    packet = func._overloadpacket
    if func.is_view or packet in NO_KERNEL:
        return None
    if packet in MATMUL:
        return "matmul"
    if packet in CONV:
        return "conv"
    if packet in RANDOM:
        return "random"
    return "attention" if packet in flop_registry else "pointwise"


def _tensors(*groups) -> list[torch.Tensor]:
    """The tensors among operator arguments: given, or in a list or tuple (an operator's arguments nest no
    deeper; torch's pytree is the slower general case)."""
    found = []
    for group in groups:
        for value in group:
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (list, tuple)):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _dtype(tensors: list[torch.Tensor]) -> str:
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), tensors[0].dtype)
    return DTYPES.get(dtype, str(dtype).removeprefix("torch."))


class OpCosts:
    """The operators seen, in buckets: (kind, dtype, log2 of the size that sets the kernel's rate) ->
    [count, FLOPs, bytes]."""

    def __init__(self):
        self.buckets: dict[tuple[str, str, int], list] = {}
        self._kinds: dict = {}
        self._flops: dict = {}

    def add(self, func, args, kwargs, out) -> None:
        kind = self._kinds.get(func, "?")
        if kind == "?":
            kind = self._kinds[func] = kind_of(func)
        if kind is None:
            return
        inputs = _tensors(args, kwargs.values() if kwargs else ())
        outputs = _tensors((out,))
        if not inputs and not outputs:
            return
        moved = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)
        flops = 0
        if kind == "random":
            pass  # bytes only: what it writes (and reads)
        elif kind == "pointwise":
            largest_in = max((t.numel() for t in inputs), default=0)
            kind = "reduction" if max((t.numel() for t in outputs), default=0) < largest_in else "elementwise"
        else:  # torch's formula, once per shape (its pytree walk costs more than the rest of `add`)
            shapes = (func, *(t.shape for t in inputs), *(t.shape for t in outputs))
            flops = self._flops.get(shapes)
            if flops is None:
                flops = self._flops[shapes] = flop_registry[func._overloadpacket](
                    *args, **(kwargs or {}), out_val=out
                )
        size = flops or moved
        key = (kind, _dtype(inputs or outputs), int(math.log2(size)) if size > 0 else 0)
        entry = self.buckets.get(key)
        if entry is None:
            self.buckets[key] = [1, flops, moved]
        else:
            entry[0] += 1
            entry[1] += flops
            entry[2] += moved

    def ops(self) -> tuple[OpCost, ...]:
        return tuple(
            OpCost(kind, dtype, count, flops, moved)
            for (kind, dtype, _), (count, flops, moved) in sorted(self.buckets.items())
        )
