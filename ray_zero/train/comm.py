"""What a rank sends: every collective an engine issues through torch.distributed's Python functions
(DeepSpeed's comm layer, FSDP2, ZeroRedundancyOptimizer, and DDP through its Python all-reduce hook),
counted by kind while a `CommCounter` is on, with the time the rank is held up by them.

A collective's bytes are its message as nccl-tests sizes it: an all-reduce's, broadcast's or reduce's
tensor, a reduce-scatter's whole input, an all-gather's whole output. Nothing crosses ranks at world size
1, so nothing is counted there. The rank is held up where it waits for a collective: inside a blocking
call, or in `Work.wait()` of an asynchronous one (on a GPU, the time its stream waits, by CUDA events).
The wrappers are put in place once per process, before any engine looks the functions up (DeepSpeed keeps
the ones it found), and cost one check of a flag while no counter is on.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


def _nbytes(tensors: Any) -> int:
    """Bytes of floating-point tensors and raw bytes (uint8: FSDP2 gathers a group of mixed dtypes as
    bytes; DeepSpeed's overflow flag): the model's data. Other integer and boolean messages are an engine's
    bookkeeping (ZeRO-3's checks that ranks traced the same modules: lists of ids), not counted."""
    if isinstance(tensors, torch.Tensor):
        data = tensors.is_floating_point() or tensors.dtype == torch.uint8
        return tensors.numel() * tensors.element_size() if data else 0
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


# name -> (kind, the message's bytes from the call's arguments)
_SIZES: dict[str, tuple[str, Callable[..., int]]] = {
    "all_reduce": ("all_reduce", lambda tensor, *a, **k: _nbytes(tensor)),
    "reduce": ("reduce", lambda tensor, *a, **k: _nbytes(tensor)),
    "broadcast": ("broadcast", lambda tensor, *a, **k: _nbytes(tensor)),
    "reduce_scatter_tensor": ("reduce_scatter", lambda output, input, *a, **k: _nbytes(input)),
    "_reduce_scatter_base": ("reduce_scatter", lambda output, input, *a, **k: _nbytes(input)),
    "reduce_scatter": ("reduce_scatter", lambda output, input_list, *a, **k: _nbytes(input_list)),
    # FSDP2's, from torch 2.14
    "reduce_scatter_single": ("reduce_scatter", lambda output, input, *a, **k: _nbytes(input)),
    "all_gather_into_tensor": ("all_gather", lambda output_tensor, *a, **k: _nbytes(output_tensor)),
    "_all_gather_base": ("all_gather", lambda output_tensor, *a, **k: _nbytes(output_tensor)),
    "all_gather": ("all_gather", lambda tensor_list, *a, **k: _nbytes(tensor_list)),
    "all_gather_single": ("all_gather", lambda output_tensor, *a, **k: _nbytes(output_tensor)),
    "_broadcast_coalesced": ("broadcast", lambda group, tensors, *a, **k: _nbytes(tensors)),
}
_ACTIVE: Optional["CommCounter"] = None
_CALLS = threading.local()
"""`depth`: counted calls under way in this thread's call stack: torch's blocking collectives wait on
their Work in Python, and some call another collective; only the outermost is counted and timed."""


class CommCounter:
    """Collectives by kind (calls, bytes) and the time they held the rank up, while it is on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.held_s = 0.0
        self._events: list[tuple[Any, Any]] = []

    def __enter__(self) -> "CommCounter":
        global _ACTIVE
        install()
        _ACTIVE = self
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = None

    def count(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def held(self, run: Callable[[], Any]) -> Any:
        """Run `run` (a blocking collective or a wait), adding the time it holds the rank up."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = run()
            end.record()
            self._events.append((start, end))
            return result
        started = time.perf_counter()
        try:
            return run()
        finally:
            self.held_s += time.perf_counter() - started

    def take_held(self) -> Any:
        """The holds since the last call: seconds (CPU), or the CUDA events' pairs, which `seconds` reads
        once the device has caught up."""
        held = self._events if self.device.type == "cuda" else self.held_s
        self.held_s, self._events = 0.0, []
        return held

    @staticmethod
    def seconds(held: Any) -> float:
        if isinstance(held, list):
            return sum(start.elapsed_time(end) / 1000 for start, end in held)
        return float(held or 0.0)

    def per_step(self, steps: int) -> dict[str, int]:
        """Bytes each kind of collective sent, per step (the counts over `steps` timed steps)."""
        steps = max(steps, 1)
        return {
            f"comm_{kind}_bytes": total // steps if total % steps == 0 else total / steps
            for kind, total in ((kind, self.bytes.get(kind, 0)) for kind in KINDS)
        }


def _counting(name: str, function: Callable) -> Callable:
    kind, size = _SIZES[name]

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        counter = _ACTIVE
        if counter is None or getattr(_CALLS, "depth", 0):  # off, or inside a counted call (its own wait)
            return function(*args, **kwargs)
        group = kwargs.get("group") if name != "_broadcast_coalesced" else args[0]
        _CALLS.depth = 1
        try:
            if kwargs.get("async_op"):
                result = function(*args, **kwargs)  # its wait is timed where it is waited for
            else:
                result = counter.held(lambda: function(*args, **kwargs))
        finally:
            _CALLS.depth = 0
        # Counted once it went through: an engine that catches a refusal (a backend without the
        # collective) and falls back to another sends its bytes once, through the fallback.
        if _world(group) > 1:
            counter.count(kind, size(*args, **kwargs))
        return result

    wrapper.ray_zero_counting = True
    return wrapper


_installed = False


def install() -> None:
    """The counting wrappers in torch.distributed (once per process) and around Work.wait."""
    global _installed
    if _installed:
        return
    for name in _SIZES:
        function = getattr(dist, name, None)
        if function is not None and not getattr(function, "ray_zero_counting", False):
            setattr(dist, name, _counting(name, function))
            if hasattr(dist.distributed_c10d, name):
                setattr(dist.distributed_c10d, name, getattr(dist, name))
    work = dist.distributed_c10d.Work
    wait = work.wait

    def timed_wait(self, *args, **kwargs):
        counter = _ACTIVE
        if counter is None or getattr(_CALLS, "depth", 0):
            return wait(self, *args, **kwargs)
        return counter.held(lambda: wait(self, *args, **kwargs))

    work.wait = timed_wait
    _installed = True
