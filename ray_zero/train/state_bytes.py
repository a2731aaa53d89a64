"""What one rank holds of the model states, counted tensor by tensor: parameters, gradients, master
copies, optimizer states, and what a DeepSpeed optimizer wrapper keeps besides (buckets, flat buffers).
Each storage once, a DTensor (FSDP2) by its local shard. torch only; DeepSpeed's wrappers are read by
their attributes, never imported here.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _innermost_torch_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """DeepSpeed wraps the torch optimizer (FP16_Optimizer, ZeRO, BF16_Optimizer): unwrap it."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer) and not isinstance(inner, torch.optim.Optimizer):
            return optimizer
        optimizer = inner
    return None


def _tensors_in(
    obj: Any, grads: bool = True, depth: int = 0, seen: Optional[set] = None
) -> Iterable[torch.Tensor]:
    """Tensors reachable from a DeepSpeed optimizer wrapper's attributes (lists, dicts, tensors), with their
    gradients unless not `grads`."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if grads and obj.grad is not None:
            yield obj.grad
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, grads, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value, grads, depth + 1, seen)
    elif type(obj).__module__.startswith("deepspeed.runtime") and not isinstance(obj, torch.nn.Module):
        for value in vars(obj).values():
            yield from _tensors_in(value, grads, depth + 1, seen)


# Where DeepSpeed 0.19.8's optimizer wrappers keep what the torch optimizer beneath cannot show: ZeRO-3
# clears the inner optimizer's param_groups between steps and keeps its fp32 master and gradient
# partition in flat buffers of its own (read on CPU, stages 0-3, fp32 and bf16).
_DEEPSPEED_MASTERS = (
    "single_partition_of_fp32_groups",
    "fp32_partitioned_groups_flat",
    "fp32_groups_flat_partition",
)
_DEEPSPEED_GRADIENTS = (
    "averaged_gradients",
    "grads_in_partition",
    "grad_partitions_flat_buffer",
    "fp32_groups_gradients_flat",
    "fp32_groups_gradients",
)


def state_bytes(module: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes this rank holds, by kind, counting each tensor storage once (a DTensor by its local shard).

    parameter: the module's parameters (low precision under DeepSpeed fp16/bf16), with ZeRO-3's partition of
    each; gradient: gradients of the module's parameters and of the fp32 master partition, and DeepSpeed's
    gradient partitions; master: the fp32 master copy this rank owns (none when the optimizer steps the
    module's own parameters); optimizer_state: the torch optimizer's states (Adam's two moments, step);
    other: any further tensor a DeepSpeed optimizer wrapper holds (buckets, flat buffers). `optimizer` is
    the torch optimizer over this rank's parameters, or DeepSpeed's wrapper of it.
    """
    counted: set[tuple[str, int]] = set()
    result = {
        "parameter_bytes": 0,
        "gradient_bytes": 0,
        "master_param_bytes": 0,
        "optimizer_state_bytes": 0,
        "other_optimizer_bytes": 0,
    }

    def add(kind: str, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            tensor = _local(tensor)
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key not in counted:
                counted.add(key)
                result[kind] += storage.nbytes()

    inner = _innermost_torch_optimizer(optimizer)
    wrapper = optimizer if optimizer is not None and optimizer is not inner else None  # DeepSpeed's
    inner_params = [p for group in inner.param_groups for p in group["params"]] if inner else []
    module_params = list(module.parameters())
    add("parameter_bytes", (p.data for p in module_params))
    add(
        "parameter_bytes", (p.ds_tensor for p in module_params if hasattr(p, "ds_tensor"))
    )  # ZeRO-3's partition
    add(
        "optimizer_state_bytes",
        (
            value
            for state in (inner.state.values() if inner else ())
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ),
    )
    add("master_param_bytes", (p.data for p in inner_params))  # nothing new when p is a module parameter
    for name in _DEEPSPEED_MASTERS if wrapper else ():
        add("master_param_bytes", _tensors_in(getattr(wrapper, name, None), grads=False))
    add("gradient_bytes", (p.grad for p in module_params + inner_params if p.grad is not None))
    for name in _DEEPSPEED_GRADIENTS if wrapper else ():
        add("gradient_bytes", _tensors_in(getattr(wrapper, name, None)))
    if wrapper is not None:
        add("other_optimizer_bytes", _tensors_in(wrapper))
    return result
