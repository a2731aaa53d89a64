"""The step timer: wall time of the timed steps, the training thread's CPU time and the collector's."""
from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
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


def test_step_timer_counts_the_kernels_part_and_page_faults():
    """Touching fresh memory faults each page in, in the kernel, on the training thread's clock."""
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    for _ in range(4):
        fresh = bytearray(128 << 20)  # 128 MiB, zeroed: every page touched
        del fresh
    timer.stop()
    assert timer.minor_faults >= 100  # 512 MiB touched: 256 faults even in 2 MiB huge pages, 131,072 in 4 KiB
    assert 0 < timer.thread_system_s <= timer.thread_cpu_s + 0.01


def test_step_timer_counts_the_other_threads_cpu_apart_from_its_own():
    """A busy thread beside the training thread (as autograd's device thread is on a GPU) is counted as
    the busiest other thread, and not in the training thread's own CPU time."""
    done, stop = threading.Event(), threading.Event()

    def busy():
        ctypes.CDLL(None).prctl(15, b"busy-helper")  # PR_SET_NAME, as torch names pt_autograd_0
        until = time.thread_time() + 0.5
        while time.thread_time() < until:
            pass
        done.set()
        stop.wait()  # alive until the timer stops: a thread that has ended is gone from /proc

    timer = StepTimer(torch.device("cpu"))
    timer.start()
    helper = threading.Thread(target=busy)
    helper.start()
    done.wait()
    timer.stop()
    stop.set()
    helper.join()
    assert 0.4 <= timer.busiest_other_thread_cpu_s <= timer.other_threads_cpu_s
    assert timer.busiest_other_thread_name == "busy-helper"
    assert timer.thread_cpu_s < 0.2  # the training thread only waited


def test_step_timer_laps_split_the_timed_time_by_phase_and_only_while_timing():
    timer = StepTimer(torch.device("cpu"))
    timer.lap("forward")  # before start: not counted
    timer.start()
    for _ in range(3):
        time.sleep(0.01)
        timer.lap("forward")
        time.sleep(0.03)
        timer.lap("backward")
    elapsed = timer.stop()
    timer.lap("backward")  # after stop: not counted
    assert 0.03 <= timer.phase_s["forward"] < 0.06
    assert 0.09 <= timer.phase_s["backward"] < 0.15
    assert sum(timer.phase_s.values()) <= elapsed


def test_step_timer_tells_waiting_for_a_core_from_blocking():
    """A training thread that shares its only core with a busy process waits in the run queue; one that
    sleeps blocks (a voluntary switch each time)."""
    original = os.sched_getaffinity(0)
    cpu = min(original)
    os.sched_setaffinity(0, {cpu})  # this thread only (Linux: pid 0 is the calling thread)
    rival = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"],
                             preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        time.sleep(0.3)  # the rival is running
        timer = StepTimer(torch.device("cpu"))
        timer.start()
        for _ in range(20):
            time.sleep(0.001)
        busy_until = time.thread_time() + 0.4
        while time.thread_time() < busy_until:
            pass
        timer.stop()
    finally:
        rival.kill()
        rival.wait()
        os.sched_setaffinity(0, original)
    assert timer.voluntary_switches >= 20
    assert timer.run_queue_s > 0.2  # on one core with a busy rival, about as long as it ran
    assert timer.thread_cpu_s + timer.run_queue_s <= timer.elapsed_s + 0.01


def test_step_timer_counts_the_training_threads_moves_between_cpus():
    """Pinned to one CPU, then another, the thread must move once at least: Linux's count of it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nowhere to move to")
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    try:
        for cpu in (cpus[0], cpus[1], cpus[0]):
            os.sched_setaffinity(0, {cpu})  # this thread only (Linux)
            sum(range(200_000))
    finally:
        os.sched_setaffinity(0, cpus)
    timer.stop()
    assert timer.migrations is not None and timer.migrations >= 1


def test_speed_probe_times_fixed_work_and_reads_the_process_memory():
    from ray_zero import speed_probe

    figures = speed_probe.measure()
    assert 0 < figures["probe_python_loop_ms"] < 5_000
    assert 0 < figures["probe_dispatch_us"] < 10_000
    assert 0 < figures["probe_gather_ms"] < 10_000
    assert figures["probe_rss_mib"] >= 256  # its 256 MiB of random-read memory is resident when it reads
    assert figures["probe_anon_huge_mib"] >= 0
