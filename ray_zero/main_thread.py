"""Keep a Ray actor's main thread asleep while a thread of that actor trains.

Ray Train runs the training function in a thread of its worker actor, and the actor's main thread goes
back to Ray's task loop, which wakes every 10 ms (Ray's `CoreWorker.CheckSignal`, fixed in C++) and takes
the GIL each time. A host-bound step releases the GIL at every torch call, so the training thread often
finds the GIL taken when it returns, and waits for the main thread to be scheduled and to give it back
(bench/README.md: "The 10 ms signal check").

Held, the main thread runs one actor task after another (`__ray_call__`, Ray's way to run a function on
an actor), each sleeping without the GIL until training ends or `hold_s` passes, then queueing the next;
between two of them the main thread runs what arrived meanwhile (Ray Train's status poll, a shutdown) and
checks signals once. Ray Train waits for a poll that is held back (up to 10 minutes before it calls a
rank lost), so a report or a shutdown waits at most `hold_s` more, and the end of training not at all.
Measured on a 2-core CPU: bench/host_loop.py's loop in such a thread blocked 0.079 times a step, 0.014
held, and never in a plain process; a rank's main thread blocked 144 times a second free, fewer than 8
held (bench/results/thread-wakes-cpu-2core). A first version waited for each hold in a helper thread,
whose own wake-ups took the GIL too (on the H200 1.23-1.25 blocks a step, against 1.13-1.20 now).
"""
from __future__ import annotations

import threading
import uuid
from typing import Any

_HOLDS: dict[str, tuple[threading.Event, Any]] = {}  # per hold: (set when training ends, the actor's handle)


def _sleep_on_main_thread(instance, key: str, hold_s: float) -> None:
    """An actor task (`instance`: the actor's object, which __ray_call__ passes first): sleep until
    training ends or `hold_s` passes, then queue the next one."""
    hold = _HOLDS.get(key)
    if hold is None:
        return
    done, actor = hold
    if not done.wait(hold_s):  # without the GIL; returns at once when training ends
        try:  # behind whatever arrived meanwhile (Ray Train's polls)
            actor.__ray_call__.remote(_sleep_on_main_thread, key, hold_s)
        except Exception:  # the actor is going away: nothing left to hold
            pass


class HoldMainThread:
    """`with HoldMainThread():` around training in a thread of a Ray actor; elsewhere it does nothing."""

    def __init__(self, hold_s: float = 1.0):
        self.hold_s = hold_s
        self.active = False  # whether it holds: only in a thread of a Ray actor
        self._key = uuid.uuid4().hex

    def __enter__(self) -> "HoldMainThread":
        import ray

        if not ray.is_initialized() or threading.current_thread() is threading.main_thread():
            return self
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return self
        actor = context.current_actor
        _HOLDS[self._key] = (threading.Event(), actor)
        actor.__ray_call__.remote(_sleep_on_main_thread, self._key, self.hold_s)
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        hold = _HOLDS.pop(self._key, None)
        if hold is not None:
            hold[0].set()
