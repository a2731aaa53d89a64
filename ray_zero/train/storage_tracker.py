"""The tracker of a traced step (ray_zero/train/step_trace.py): a TorchDispatchMode that sees every operator
autograd runs and counts each new storage, rounded up to the CUDA caching allocator's 512-byte blocks,
from its creation until Python's last reference to it goes; what a step's log says at its peak. On meta it
also stands in where the meta device cannot: dropout's mask at CUDA's 1 byte an element, a grouped
matmul's output in any dtype, and the data checks a model makes of ray_zero's synthetic batches. torch
only.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ray_zero.models.source import ModelError

BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block up to a multiple of 512 bytes."""
HULL_POINTS = 64
"""At most this many (other, gradient) moments kept: the candidates for the peak at any gradient scale."""


class TraceError(ModelError):
    """The step could not be traced on meta (a data-dependent value or shape, an operator without a meta
    kernel): calibrate instead."""


_CHECKS = {
    torch.ops.aten.all.default: True,
    torch.ops.aten.all.dim: True,
    torch.ops.aten.any.default: False,
    torch.ops.aten.any.dim: False,
    torch.ops.aten.eq.Scalar: True,
    torch.ops.aten.eq.Tensor: True,
    torch.ops.aten.ne.Scalar: False,
    torch.ops.aten.ne.Tensor: False,
    torch.ops.aten._is_all_true.default: True,
    torch.ops.aten._is_any_true.default: False,
}
"""What a data check reads on ray_zero's synthetic batches (no padding, no exceptions): everything holds
(`.all()`, `mask.sum() == mask.numel()`), nothing is the exception (`.any()`)."""


def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm's output on meta for any dtype (its meta kernel refuses fp16 without a GPU's
    cuBLASLt): 2D x 3D -> tokens x N, 2D x 2D with offsets -> groups x K x N, 3D x 3D -> batched."""
    dtype = out_dtype or mat_a.dtype
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif mat_a.dim() == 2 and mat_b.dim() == 2:
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[-1])
    elif mat_a.dim() == 3 and mat_b.dim() == 2:
        shape = (mat_a.shape[1], mat_b.shape[-1])
    else:
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return torch.empty(shape, dtype=dtype, device="meta")


class StorageTracker(TorchDispatchMode):
    """Every storage an operator creates, from then until its last reference goes: a log of (storage,
    +bytes | -bytes) in order, and the live total."""

    def __init__(self, known: set[int], device_type: str, costs=None):
        super().__init__()
        self.costs = costs
        """An OpCosts (ray_zero/train/op_costs.py) that every operator is also reported to, if given."""
        self.known = known
        self.meta = device_type == "meta"
        self.sizes: dict[int, tuple[int, int]] = {}
        """A live storage's address: its name in the log and its bytes."""
        self.log: list[tuple[int, int]] = []
        self.live = 0
        self.checks: dict[int, bool] = {}
        self.op = ""
        self.made_by: dict[int, str] = {}
        """The operator that made each storage (by its name in the log)."""

    def _answer(self, tensor: torch.Tensor) -> bool:
        """A meta tensor's value, where the code only checks its data: `.all()` holds, `.any()` does not
        (Transformers' test for packed sequences, and input checks); any other value cannot be traced."""
        answer = self.checks.get(tensor.untyped_storage()._cdata)
        if answer is None:
            made = self.made_by.get(self.sizes.get(tensor.untyped_storage()._cdata, (None,))[0], "")
            raise TraceError(
                "its training step reads a value of its data (Tensor.item() of "
                f"{made or 'a tensor'} on the meta device, which cannot know it)"
            )
        return answer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.meta and func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return self._answer(args[0])
        if self.meta and func is torch.ops.aten._grouped_mm.default:
            out = _grouped_mm_meta(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        if self.costs is not None:
            self.costs.add(func, args, kwargs, out)
        self.op = func.__name__
        if self.meta and func in _CHECKS and isinstance(out, torch.Tensor) and out.dim() == 0:
            self.checks[out.untyped_storage()._cdata] = _CHECKS[func]
        if self.meta and func is torch.ops.aten.bernoulli_.float:
            # dropout's noise: CUDA's fused dropout keeps a bool mask, meta's composite one in this dtype
            self._count(out, bytes_per_element=1)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor, bytes_per_element: Optional[int] = None) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a subclass without a storage of its own
            return
        key = storage._cdata
        if key in self.known:
            return
        size = storage.nbytes() if bytes_per_element is None else tensor.numel() * bytes_per_element
        size = -(-size // BLOCK_BYTES) * BLOCK_BYTES
        if key in self.sizes:
            if bytes_per_element is not None:  # counted again, smaller (dropout's mask)
                uid, old = self.sizes[key]
                self.sizes[key] = (uid, size)
                self.live += size - old
                self.log.append((uid, size - old))
            return
        uid = len(self.log)  # a storage's address is reused once it is freed: the log names each anew
        self.sizes[key] = (uid, size)
        self.made_by[uid] = self.op
        self.live += size
        self.log.append((uid, size))
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        uid, size = self.sizes.pop(key, (None, 0))
        if uid is not None:
            self.live -= size
            self.log.append((uid, -size))

    def uid(self, tensor: torch.Tensor) -> Optional[int]:
        """The log's name for a live tensor's storage."""
        entry = self.sizes.get(tensor.untyped_storage()._cdata)
        return entry[0] if entry else None

    def bytes_of(self, tensor: torch.Tensor) -> int:
        entry = self.sizes.get(tensor.untyped_storage()._cdata)
        return entry[1] if entry else 0


class SavedBytes:
    """Autograd's saved tensors, each storage once, parameters left out (measure.meter.SavedForBackward's
    rule), at the tracker's sizes."""

    def __init__(self, tracker: StorageTracker):
        self.tracker = tracker
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not (base.is_leaf and base.requires_grad):
            storage = tensor.untyped_storage()
            if storage._cdata not in self.seen:
                self.seen.add(storage._cdata)
                self.bytes += self.tracker.bytes_of(tensor)
        return tensor


def peak_moments(
    log: list[tuple[int, int]], gradients: set[int], forward_at: int
) -> tuple[tuple[int, int], ...]:
    """The (other, gradients) totals after each event that no other moment exceeds in both."""
    other = grads = 0
    points: list[tuple[int, int]] = []
    for index, (key, delta) in enumerate(log):
        if key in gradients:
            grads += delta
        else:
            other += delta
        if delta > 0 or index == forward_at:
            points.append((other, grads))
    hull: list[tuple[int, int]] = []
    for point in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not hull or point[1] > hull[-1][1]:
            hull.append(point)
    if len(hull) > HULL_POINTS:  # keep the extremes and an even spread between them
        step = (len(hull) - 1) / (HULL_POINTS - 1)
        hull = [hull[round(i * step)] for i in range(HULL_POINTS)]
    return tuple(hull) or ((0, 0),)


def peak_composition(log: list[tuple[int, int]], made_by: dict[int, str], top: int = 10):
    """The live bytes at the log's highest moment, by the operator that made them."""
    live = best = best_at = 0
    for index, (_, delta) in enumerate(log):
        live += delta
        if live > best:
            best, best_at = live, index
    alive: dict[int, int] = {}
    for uid, delta in log[: best_at + 1]:
        alive[uid] = alive.get(uid, 0) + delta
    by_op: dict[str, int] = {}
    for uid, size in alive.items():
        if size > 0:
            by_op[made_by.get(uid, "?")] = by_op.get(made_by.get(uid, "?"), 0) + size
    ranked = sorted(by_op.items(), key=lambda item: -item[1])
    rest = sum(size for _, size in ranked[top:])
    return tuple(ranked[:top]) + ((("other", rest),) if rest else ())
