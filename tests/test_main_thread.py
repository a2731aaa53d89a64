"""HoldMainThread: a Ray actor's main thread, idle in Ray's task loop, wakes every 10 ms; held, it sleeps."""
from __future__ import annotations

import sys
import threading
import time

from ray_zero.main_thread import HoldMainThread
from ray_zero.metrics import thread_scheduling


def _main_thread_wakes_per_s(seconds: float) -> float:
    """Voluntary context switches of this process's main thread, per second, over `seconds`."""
    main = threading.main_thread().native_id
    before = thread_scheduling(main)[1]
    time.sleep(seconds)
    return (thread_scheduling(main)[1] - before) / seconds


def test_held_main_thread_stops_waking_and_still_serves_calls(ray_instance):
    ray = ray_instance
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/

    @ray.remote(num_cpus=0)
    class Rank:
        """As a Ray Train rank: the work runs in a thread that a returning call started."""

        def __init__(self):
            self.result = None

        def start(self, hold: bool) -> None:
            def work():
                with (HoldMainThread() if hold else _NoHold()) as held:
                    time.sleep(0.5)  # let the holder's first task reach the main thread
                    self.result = (held.active, _main_thread_wakes_per_s(2.0))

            self.result = None
            threading.Thread(target=work).start()

        def poll(self):
            return self.result

    def run(hold: bool):
        rank = Rank.remote()
        ray.get(rank.start.remote(hold))
        waits = []  # how long each poll took to be answered
        while True:
            asked = time.monotonic()
            result = ray.get(rank.poll.remote())
            waits.append(time.monotonic() - asked)
            if result is not None:
                break
            time.sleep(0.25)
        ray.kill(rank)
        return result, waits

    try:
        (active_free, wakes_free), _ = run(hold=False)
        (active_held, wakes_held), waits = run(hold=True)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert not active_free and active_held
    assert wakes_free > 60  # Ray's 10 ms signal check
    assert wakes_held < 30  # one hold a second, the polls, the holds' own traffic
    # Calls still reach a held main thread: answered while the work ran, each within the 1 s hold.
    assert len(waits) >= 2 and max(waits) < 2.0


def test_hold_does_nothing_outside_a_ray_actor():
    done = []

    def work():
        with HoldMainThread() as held:
            done.append(held.active)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert done == [False]


class _NoHold:
    active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
