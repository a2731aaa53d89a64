"""perf events for the training thread: the syscall, the attribute struct and the scaled read, checked with
the software task clock that every Linux kernel counts (this machine has no hardware counters)."""
from __future__ import annotations

import os
import time

import pytest

from ray_zero.cpu_counters import SOFTWARE, TASK_CLOCK, ThreadCounters, open_counter, read_counter


def test_a_perf_counter_counts_this_threads_time_on_a_cpu_and_not_its_sleep():
    fd = open_counter(SOFTWARE, TASK_CLOCK)
    try:
        started = time.thread_time()
        time.sleep(0.2)
        until = time.thread_time() + 0.3
        while time.thread_time() < until:
            pass
        counted_s = read_counter(fd) / 1e9
        cpu_s = time.thread_time() - started
    finally:
        os.close(fd)
    assert 0.3 <= counted_s <= cpu_s + 0.05  # the busy 0.3 s, not the 0.2 s asleep


def test_hardware_counters_count_work_where_the_machine_has_them():
    counters = ThreadCounters.open()
    if counters is None:  # StepTimer then leaves the counts None
        pytest.skip("no hardware performance counters on this machine (a VM or container without a PMU)")
    try:
        before = counters.read()
        sum(i * i for i in range(200_000))
        after = counters.read()
    finally:
        counters.close()
    assert after[0] > before[0] and after[1] - before[1] > 1_000_000
