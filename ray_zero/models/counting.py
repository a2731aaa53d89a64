"""Counting a model without training it: parameters, training FLOPs and autograd's saved bytes per sample.

The count runs on the meta device (no memory, no arithmetic). Some operators have no meta kernel
(`aten::_unique2`: timm 1.0.29's RegNet calls torch.unique while it builds; `Tensor.item()` cannot run
on meta either). Then describe_model falls back, and its description says which way it counted:

- the model does not *build* on meta: it is built for real on the CPU (its parameters have to exist to
  be counted), and the FLOPs and saved bytes come from a real forward and backward of one batch there;
- it builds but its forward or backward does not run on meta (an operator says so, or a torch kernel
  raises: one release's meta function refused a dtype a later one takes): the parameters are the meta
  count, and the FLOPs and saved bytes come from a real instance on the CPU if its fp32 parameters take
  at most REAL_COUNT_LIMIT_BYTES (where it fails too, the model is refused with the CPU's error), else
  they are not counted (0 FLOPs, read as unknown: the rank reports no TFLOP/s and no MFU; a GPU sweep
  calibrates its activations, from 1 sample).

torch only: no Ray, no DeepSpeed, no Transformers or timm here.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ray_zero.models.source import ModelError, one_line
from ray_zero.models.spec import Batch, ModelSpec

SAMPLES = 2
"""The batch count_one_sample counts, divided by it. Two samples: BatchNorm refuses one sample where a
feature map is 1x1 (a ResNet on 32x32 images)."""
REAL_COUNT_LIMIT_BYTES = 2 * 2**30
"""A model whose forward does not run on meta is built on the CPU to count its FLOPs only up to this much
fp32 parameters (512 M): beyond it the driver would hold gigabytes to count what is not needed to train."""
NOT_COUNTED = "FLOPs and activations not counted"
"""What a description says where the FLOPs were not counted (flops_and_saved's 0.0 means unknown)."""
META_WORDS = ("meta tensor", "meta kernel", "'meta' backend", "meta device", "device meta")


def no_meta_kernel(error: BaseException) -> bool:
    """Whether `error` says that an operator cannot run on the meta device (rather than a bad input)."""
    text = str(error).lower()
    return any(word in text for word in META_WORDS)


class NoMetaKernel(ModelError):
    """The counting forward or backward stopped at an operator the meta device cannot run."""


class Counted:
    """How a model was counted, for its description: on meta, or which fallback and why."""

    def __init__(self, note: str = ""):
        self.note = note
        """"" (all on the meta device), else the description's tail saying how and why."""


def built_on_meta_or_cpu(build: Callable[[], object]) -> tuple[object, Counted]:
    """`build()` under the meta device; where an operator has no meta kernel, `build()` on the CPU."""
    try:
        with torch.device("meta"):
            return build(), Counted()
    except Exception as error:
        if not no_meta_kernel(error):
            raise
        reason = _reason(error)
    built = build()
    return built, Counted(f"; counted on a real CPU instance ({reason})")


def flops_and_saved(
    source: str, spec: ModelSpec, counted: Counted, real_spec: Callable[[], ModelSpec]
) -> tuple[float, int, tuple[int, ...]]:
    """FLOPs, saved bytes per sample and unreached parameters of `spec` (count_one_sample, on the device
    its parameters are on). Where the forward or backward has no meta kernel: of `real_spec()` on the CPU
    if small enough (the note says so), else (0.0, 0, ()) and the note says they were not counted."""
    device = next((p.device for p in spec.module.parameters()), torch.device("cpu"))
    try:
        return count_one_sample(source, spec, device)
    except NoMetaKernel as error:
        reason = _reason(error)
    size = sum(p.numel() for p in spec.module.parameters()) * 4
    if size > REAL_COUNT_LIMIT_BYTES:
        counted.note = (
            f"; parameters counted on meta, {NOT_COUNTED} ({reason}; a real instance "
            f"would take {size / 2**30:.1f} GiB)"
        )
        return 0.0, 0, ()
    counted.note = f"; FLOPs and activations counted on a real CPU instance ({reason})"
    return count_one_sample(source, real_spec(), torch.device("cpu"))


def flops_not_counted(description: str) -> str:
    """Why a model's FLOPs are unknown (flops_and_saved gave 0: no TFLOP/s, no MFU), from its description."""
    if NOT_COUNTED in description:  # the note ends the description
        return "FLOPs not counted" + description.split(NOT_COUNTED, 1)[1]
    return "no FLOPs counted for this model"


def _may_be_meta(error: BaseException) -> bool:
    """Whether a failure on the meta device may be the device's rather than the model's: one that says so,
    or any error torch's kernels raise (a meta function of one torch release refusing a dtype,
    "unsupported scalarType"). The count on a real CPU instance (flops_and_saved) then tells which; a
    model too large for it is counted there no further and calibrated on a GPU instead of refused."""
    return no_meta_kernel(error) or type(error) in (RuntimeError, NotImplementedError)


def _reason(error: BaseException) -> str:
    """ "aten::_unique2 has no meta kernel", or the error's first words."""
    text = str(error)
    operator = re.search(r"aten::[\w.]+", text)
    if operator:
        return f"{operator.group(0)} has no meta kernel"
    text = text.split(" on the meta device: ", 1)[-1]  # count_one_sample's own words before the error's
    return text.split(" failed: ")[-1].split(" raised ")[-1][:100] + " on meta"


def count_one_sample(
    source: str, spec: ModelSpec, device: torch.device
) -> tuple[float, int, tuple[int, ...]]:
    """FlopCounterMode's count of one forward + backward of a SAMPLES batch on `device` (meta, or the
    CPU for the fallback), the bytes autograd saved for that backward (each storage once, parameters
    left out: the activations of one sample, as ray_zero.measure.meter.SavedForBackward counts them on a
    rank, in the dtype the model is built in), and the trainable parameters (indices, module order) that
    got no gradient: the loss does not reach them (a pooler a masked LM skips, a vision-language model's
    vision tower under text). The batch is made on the CPU (no meta generator exists)."""
    batch = to_device(spec.make_batch(SAMPLES, torch.device("cpu"), torch.Generator().manual_seed(0)), device)
    # Meta storages have no data pointer: a storage is known by its StorageImpl's address (_cdata).
    seen = {p.untyped_storage()._cdata for p in spec.module.parameters()}
    saved = 0
    keep: list[torch.Tensor] = []  # on a real device: storages stay alive, so no address is reused

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        base = tensor._base if tensor._base is not None else tensor
        storage = tensor.untyped_storage()
        parameter = isinstance(base, nn.Parameter) or _gathered_weights(tensor)
        if not parameter and storage._cdata not in seen:
            seen.add(storage._cdata)
            saved += storage.nbytes()
            keep.append(tensor)
        return tensor

    try:
        with (
            FlopCounterMode(display=False) as counter,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            spec.loss(spec.module, batch).backward()
    except Exception as error:
        kind = NoMetaKernel if device.type == "meta" and _may_be_meta(error) else ModelError
        raise kind(
            f"a forward and backward of one sample of {source} failed on the {device.type} device: "
            f"{one_line(error)}"
        ) from None
    finally:
        keep.clear()
    trainable = [p for p in spec.module.parameters() if p.requires_grad]
    unreached = tuple(i for i, p in enumerate(trainable) if p.grad is None)
    spec.module.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()) / SAMPLES, saved // SAMPLES, unreached


def _gathered_weights(tensor: torch.Tensor) -> bool:
    """Rows of a parameter indexed out (batched_mm's per-token copies of its experts' weights): counting's
    stand-in for the grouped_mm that trains, which keeps no such copies."""
    function = tensor.grad_fn
    return (
        function is not None
        and type(function).__name__ == "IndexBackward0"
        and any(type(parent).__name__ == "AccumulateGrad" for parent, _ in function.next_functions)
    )


def to_device(batch: Batch, device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch
