"""One training step (forward, loss, backward) traced on the meta device, every tensor's allocation and
free followed: what one micro-batch adds to a rank's memory, before anything runs.

The model is built on meta (no memory, no arithmetic) in the form the point's engine trains it
(`module_form`): DeepSpeed casts it to fp16/bf16; FSDP2 computes in fp16/bf16 with its norms' statistics
in fp32; PyTorch DDP (torch_zero) keeps fp32 parameters under autocast; fp32 is fp32. A
TorchDispatchMode (`StorageTracker`) sees every operator autograd runs, forward and backward, and counts
each new storage (rounded up to the CUDA caching allocator's 512-byte blocks) from its creation until
Python's last reference to it goes. The kernels a GPU would pick where meta takes another path come from
ray_zero/train/cuda_kernels.py (fused attention, autocast); dropout's mask is counted at CUDA's 1 byte an
element. Parameters, buffers and the batch exist before the step and are not counted; the gradients are
followed apart, because each engine keeps them its own way (`StepTrace.rise`).

A model whose step needs a value the meta device cannot give (`.item()` on data, an output whose shape
depends on the data) cannot be traced: `TraceError`, one line, and the caller falls back to calibration.
torch only: no Ray, no DeepSpeed.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ray_zero.models.counting import built_on_meta_or_cpu, no_meta_kernel
from ray_zero.models.source import ModelError, one_line
from ray_zero.models.spec import ModelSpec
from ray_zero.train.cuda_kernels import cuda_kernels
from ray_zero.train.precision import LOW, cast_float_buffers

BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every block up to a multiple of 512 bytes."""
HULL_POINTS = 64
"""At most this many (other, gradient) moments kept: the candidates for the peak at any gradient scale."""


class TraceError(ModelError):
    """The step could not be traced on meta (a data-dependent value or shape, an operator without a meta
    kernel): calibrate instead."""


@dataclass(frozen=True)
class StepTrace:
    """What one micro-batch's forward, loss and backward add to the memory of a rank, traced."""

    micro_batch: int
    form: str
    """How the module ran: "bf16", "fp16", "fp32", or "fp32, bf16 autocast" (module_form)."""
    checkpointing: bool
    moments: tuple[tuple[int, int], ...]
    """(bytes of everything but parameter gradients, bytes of parameter gradients) at the moments that can
    be the step's peak, whatever an engine does with the gradients."""
    forward_bytes: int
    """Live at the loss, before backward: the activations autograd keeps, and the loss's own."""
    saved_bytes: int
    """What autograd saved for backward (each storage once, parameters left out), as a rank counts it."""
    gradient_bytes: int
    """The gradients the traced module made (in its own dtype)."""
    attention: tuple[tuple[str, int], ...] = ()
    """Attention kernels taken, and how often."""
    composition: tuple[tuple[str, int], ...] = ()
    """At the step's peak (gradients as traced): the live bytes by the operator that made them, largest
    first (the operators past the tenth summed as "other")."""
    seconds: float = 0.0

    def rise(self, gradient_bytes: float) -> float:
        """The step's peak above what was allocated before it, for an engine that holds `gradient_bytes` of
        gradients by the end of backward, made as the traced ones are (0: it writes them into buffers it
        allocated before the step, DeepSpeed ZeRO-3)."""
        scale = gradient_bytes / self.gradient_bytes if self.gradient_bytes else 0.0
        return max(other + scale * grads for other, grads in self.moments)


@dataclass(frozen=True)
class Form:
    """The module as an engine trains it: parameter dtype, autocast, input dtype, buffers' rule."""

    params: torch.dtype
    autocast: Optional[torch.dtype]
    inputs: torch.dtype
    keep_norms: Optional[bool]
    """cast_float_buffers' keep_norms (None: buffers left as built, fp32 training)."""
    norms_fp32: bool = False
    """BatchNorm parameters stay fp32 (FSDP2's own group for each)."""

    @property
    def name(self) -> str:
        if self.autocast is not None:
            return f"fp32, {_NAMES[self.autocast]} autocast"
        return _NAMES[self.params]


_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def module_form(backend: str, precision: str) -> Form:
    """How `backend` runs the module at `precision` (ray_zero/train/deepspeed_engine.py, torch_engines.py)."""
    low = LOW.get(precision)
    if low is None:
        return Form(torch.float32, None, torch.float32, None)
    if backend == "torch_zero":
        return Form(torch.float32, low, torch.float32, None)
    if backend == "fsdp":
        return Form(low, None, low, keep_norms=True, norms_fp32=True)
    return Form(low, None, low, keep_norms=False)


_CHECKS = {
    torch.ops.aten.all.default: True,
    torch.ops.aten.all.dim: True,
    torch.ops.aten.any.default: False,
    torch.ops.aten.any.dim: False,
    torch.ops.aten.eq.Scalar: True,
    torch.ops.aten.eq.Tensor: True,
    torch.ops.aten.ne.Scalar: False,
    torch.ops.aten.ne.Tensor: False,
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

    def __init__(self, known: set[int], device_type: str):
        super().__init__()
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
            raise TraceError(
                "its training step reads a value of its data (Tensor.item() on a value the meta device "
                "cannot know)"
            )
        return answer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.meta and func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return self._answer(args[0])
        if self.meta and func is torch.ops.aten._grouped_mm.default:
            out = _grouped_mm_meta(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
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


class _Saved:
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


def prepare(spec: ModelSpec, form: Form, checkpointing: bool) -> None:
    """`spec.module` in `form`, in training mode, checkpointing its blocks if asked (as the engines do)."""
    module = spec.module.train()
    module.to(form.params)
    if form.norms_fp32:
        for norm in module.modules():
            if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
                norm.float()
    if form.keep_norms is not None:
        cast_float_buffers(module, _NAMES[form.params], keep_norms=form.keep_norms)
        if not form.keep_norms and any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules()
        ):
            for buffer in module.buffers():  # DeepSpeed's buffer_dtype for BatchNorm networks (ds_config.py)
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(form.params)
    if checkpointing:
        if spec.enable_checkpointing is not None:
            spec.enable_checkpointing(module)
        elif spec.blocks:
            from ray_zero.models.source import checkpoint_blocks

            checkpoint_blocks(spec.blocks)(module)
        else:
            raise TraceError("the model cannot be checkpointed: its spec has neither blocks nor a function")


def trace_step(
    spec: ModelSpec, micro_batch: int, form: Form, checkpointing: bool = False, device: str = "meta"
) -> StepTrace:
    """Trace one forward, loss and backward of `micro_batch` samples of `spec` (already in `form`, its
    parameters on `device`: meta, or a real device to check the trace against)."""
    started = time.perf_counter()
    module = spec.module
    generator = torch.Generator().manual_seed(0)
    batch = tree_map(
        lambda t: _to(t, device, form.inputs), spec.make_batch(micro_batch, torch.device("cpu"), generator)
    )
    known = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}
    known |= {t.untyped_storage()._cdata for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)}
    tracker = StorageTracker(known, device)
    saved = _Saved(tracker)
    module.zero_grad(set_to_none=True)
    try:
        with cuda_kernels(form.autocast if device == "meta" else None) as kernels, tracker:
            autocast = (
                torch.autocast(device, dtype=form.autocast)
                if form.autocast is not None and device != "meta"
                else _nothing()
            )
            with autocast, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = spec.loss(module, batch)
            kernels.end_forward()
            forward_bytes = tracker.live
            forward_at = len(tracker.log)
            loss.backward()
            del loss
            attention = tuple(sorted(kernels.choices.items()))
    except TraceError:
        raise
    except Exception as error:
        raise TraceError(f"its training step does not run on the meta device: {_why(error)}") from None
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    gradients = {tracker.uid(g) for g in grads} - {None}
    gradient_bytes = sum(tracker.bytes_of(g) for g in {id(g): g for g in grads}.values())
    module.zero_grad(set_to_none=True)
    moments = _moments(tracker.log, gradients, forward_at)
    composition = _composition(tracker.log, tracker.made_by)
    return StepTrace(
        micro_batch=micro_batch,
        form=form.name,
        checkpointing=checkpointing,
        moments=moments,
        forward_bytes=forward_bytes,
        saved_bytes=saved.bytes,
        gradient_bytes=gradient_bytes,
        attention=attention,
        composition=composition,
        seconds=time.perf_counter() - started,
    )


def _moments(log: list[tuple[int, int]], gradients: set[int], forward_at: int) -> tuple[tuple[int, int], ...]:
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


def _composition(log: list[tuple[int, int]], made_by: dict[int, str], top: int = 10):
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


def _to(value: Any, device: str, dtype: torch.dtype) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = value.to(device)
    return value.to(dtype) if value.is_floating_point() else value


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _why(error: BaseException) -> str:
    text = one_line(error)
    if no_meta_kernel(error) or "data-dependent" in text or "Cannot copy out of meta" in text:
        return f"{text} (a value or shape that depends on the data)"
    return text


def build_on_meta(build) -> ModelSpec:
    """`build()` (a ModelSpec) on the meta device; a model that only builds on the CPU is moved there."""
    built, counted = built_on_meta_or_cpu(build)
    spec = built.spec if hasattr(built, "spec") else built
    if counted.note:
        spec.module.to("meta")
    return spec
