"""What a rank sends: every collective an engine issues through torch.distributed's Python functions
(DeepSpeed's comm layer, FSDP2, ZeroRedundancyOptimizer, DDP's buffer broadcast) and what DDP's C++
reducer all-reduces, counted by kind inside `counting(counter)`, with the time the rank is held up by them.

The wrappers exist only inside `counting`: untimed steps after the timed window (ray_zero/train/steps.py).
The timed steps run torch.distributed's own functions, DDP's own reducer and no comm hook; `installed()`
says whether any wrapper is in place. Inside `counting` the wrappers replace torch.distributed's
functions, `Work.wait`, and the references DeepSpeed's communication backend took of them when it
started (it keeps its all-gather and reduce-scatter functions); on exit the originals go back.

A collective's bytes are its message as nccl-tests sizes it: an all-reduce's, broadcast's or reduce's
tensor, a reduce-scatter's whole input, an all-gather's whole output. Nothing crosses ranks at world size
1, so nothing is counted there. The rank is held up where it waits for a collective: inside a blocking
call, or in `Work.wait()` of an asynchronous one (on a GPU, the time its stream waits, by CUDA events).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

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
_MISSING = object()
DEEPSPEED_BACKEND = "deepspeed.comm.comm"
"""The module holding DeepSpeed's communication backend (`cdb`), looked up only if DeepSpeed is loaded."""


class CommCounter:
    """Collectives by kind (calls, bytes) and the time they held the rank up, while it counts."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.held_s = 0.0
        self._events: list[tuple[Any, Any]] = []

    def count(self, kind: str, nbytes: int, calls: int = 1) -> None:
        self.calls[kind] += calls
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
        """Bytes each kind of collective sent, per step (the counts over `steps` counted steps)."""
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


def _timed_wait(wait: Callable) -> Callable:
    @functools.wraps(wait)
    def timed_wait(self, *args, **kwargs):
        counter = _ACTIVE
        if counter is None or getattr(_CALLS, "depth", 0):
            return wait(self, *args, **kwargs)
        return counter.held(lambda: wait(self, *args, **kwargs))

    timed_wait.ray_zero_counting = True
    return timed_wait


def installed() -> list[str]:
    """The wrappers in place now (torch.distributed's functions, Work.wait, DeepSpeed's backend's
    references): empty outside `counting`."""
    found = [
        f"{module.__name__}.{name}"
        for module in (dist, dist.distributed_c10d)
        for name in _SIZES
        if getattr(getattr(module, name, None), "ray_zero_counting", False)
    ]
    if getattr(dist.distributed_c10d.Work.__dict__.get("wait"), "ray_zero_counting", False):
        found.append("Work.wait")
    backend = getattr(sys.modules.get(DEEPSPEED_BACKEND), "cdb", None)
    found += [
        f"deepspeed cdb.{attribute}"
        for attribute, value in (vars(backend).items() if backend is not None else ())
        if getattr(value, "ray_zero_counting", False)
    ]
    return found


@contextlib.contextmanager
def counting(counter: CommCounter) -> Iterator[CommCounter]:
    """Count the collectives issued inside it into `counter` (and time their holds); torch.distributed,
    Work.wait and DeepSpeed's backend as they were, outside it."""
    global _ACTIVE
    outer = _ACTIVE  # a counting around this one counts again once this one ends
    originals = {name: getattr(dist, name) for name in _SIZES if hasattr(dist, name)}
    wrappers = {name: _counting(name, function) for name, function in originals.items()}
    by_function = {id(function): wrappers[name] for name, function in originals.items()}
    restore: list[tuple[Any, str, Any]] = []

    def put(owner: Any, attribute: str, value: Any) -> None:
        restore.append((owner, attribute, vars(owner).get(attribute, _MISSING)))
        setattr(owner, attribute, value)

    try:
        for name, wrapper in wrappers.items():
            put(dist, name, wrapper)
            if hasattr(dist.distributed_c10d, name):
                put(dist.distributed_c10d, name, wrapper)
        work = dist.distributed_c10d.Work
        put(work, "wait", _timed_wait(work.wait))
        # DeepSpeed's backend looked its all-gather and reduce-scatter functions up when it started.
        backend = getattr(sys.modules.get(DEEPSPEED_BACKEND), "cdb", None)
        for attribute, value in list(vars(backend).items() if backend is not None else ()):
            if callable(value) and id(value) in by_function:
                put(backend, attribute, by_function[id(value)])
        _ACTIVE = counter
        yield counter
    finally:
        _ACTIVE = outer
        for owner, attribute, value in reversed(restore):
            if value is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, value)
