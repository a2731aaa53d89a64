"""ray_zero.clock: a process's start on the wall clock that the other marks use."""
import subprocess
import sys
import time

from ray_zero.clock import process_started_at

TICK_S = 0.03  # a process's start is counted in 10 ms clock ticks, and /proc/uptime in 10 ms


def test_a_new_process_starts_after_it_was_asked_for_and_before_its_first_time_reading():
    # psutil's create_time() reads up to 1 s early (whole-second boot time): 0.81 s on the dev machine,
    # so it fails the first bound there; a slow start of the child moves neither bound.
    asked = time.time()
    child = subprocess.Popen([sys.executable, "-S", "-c", "import time; print(repr(time.time()), flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        first_reading = float(child.stdout.readline())
        started = process_started_at(child.pid)
    finally:
        child.kill()
        child.wait()
    assert asked - TICK_S <= started <= first_reading + TICK_S


def test_this_process_started_before_now():
    assert process_started_at() < time.time()
