"""The step timer: wall time of the timed steps, the training thread's CPU time and the collector's."""
from __future__ import annotations

import gc
import time

import torch

from ray_zero.metrics import StepTimer


def test_step_timer_tells_waiting_from_working_and_counts_the_garbage_collector():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.3)  # waiting: wall time without CPU time
    busy_until = time.thread_time() + 0.3
    while time.thread_time() < busy_until:  # working: both
        pass
    for _ in range(5):
        gc.collect()
    timer.stop()
    assert timer.elapsed_s >= 0.6
    assert 0.3 <= timer.thread_cpu_s <= timer.elapsed_s - 0.25
    assert 0 < timer.gc_s < timer.elapsed_s
    counted = timer.gc_s
    gc.collect()  # after stop() the collector is no longer watched
    assert timer.gc_s == counted
