"""One training step (forward, loss, backward) traced on the meta device, every tensor's allocation and free
followed: what one micro-batch adds to a rank's memory, before anything runs.

The model is built on meta (no memory, no arithmetic) in the form the point's engine trains it
(`module_form`): DeepSpeed casts it to fp16/bf16; FSDP2 computes in fp16/bf16 with its norms' statistics
in fp32; PyTorch DDP (torch_zero) keeps fp32 parameters under autocast; fp32 is fp32. A TorchDispatchMode
(`StorageTracker`, ray_zero/train/storage_tracker.py) sees every operator autograd runs, forward and
backward, and counts each new storage (rounded up to the CUDA caching allocator's 512-byte blocks) from
its creation until Python's last reference to it goes. The kernels a GPU would pick where meta takes
another path come from ray_zero/train/cuda_kernels.py (fused attention, autocast); dropout's mask is
counted at CUDA's 1 byte an element. Parameters, buffers and the batch exist before the step and are not
counted; the gradients are followed apart, because each engine keeps them its own way (`StepTrace.rise`).

A model whose step needs a value the meta device cannot give (`.item()` on data, an output whose shape
depends on the data) cannot be traced: `TraceError`, one line, and the caller falls back to calibration.
torch only: no Ray, no DeepSpeed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ray_zero.measure.step_time import OpCost
from ray_zero.models.counting import built_on_meta_or_cpu, no_meta_kernel
from ray_zero.models.source import one_line
from ray_zero.models.spec import ModelSpec, cast_floating
from ray_zero.train.cuda_kernels import cuda_kernels
from ray_zero.train.op_costs import OpCosts
from ray_zero.train.precision import LOW, cast_float_buffers
from ray_zero.train.storage_tracker import (
    SavedBytes,
    StorageTracker,
    TraceError,
    peak_composition,
    peak_moments,
)


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
    ops: tuple[OpCost, ...] = ()
    """The step's kernels (forward, loss, backward; a checkpointed block's recompute too) in buckets of alike
    operators, with their FLOPs and bytes (ray_zero/train/op_costs.py): what measure/step_time.py costs."""
    seconds: float = 0.0

    @property
    def flops(self) -> float:
        return sum(op.flops for op in self.ops)

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
    # The batch as the rank holds it (made once, before the step), then cast for the engine within the
    # step, as steps.py casts each micro-batch: the cast copy is the step's (fp32 images under bf16).
    made = tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
        spec.make_batch(micro_batch, torch.device("cpu"), generator),
    )
    known = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]}
    known |= {t.untyped_storage()._cdata for t in tree_flatten(made)[0] if isinstance(t, torch.Tensor)}
    costs = OpCosts()
    tracker = StorageTracker(known, device, costs)
    saved = SavedBytes(tracker)
    module.zero_grad(set_to_none=True)
    try:
        with cuda_kernels(form.autocast if device == "meta" else None) as kernels, tracker:
            batch = cast_floating(made, form.inputs)
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
    moments = peak_moments(tracker.log, gradients, forward_at)
    composition = peak_composition(tracker.log, tracker.made_by)
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
        ops=costs.ops(),
        seconds=time.perf_counter() - started,
    )


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
