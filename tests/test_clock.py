"""ray_zero.clock: a process's start on the wall clock that the other marks use."""
import subprocess
import sys
import time

from ray_zero.clock import process_started_at


def test_a_new_process_starts_just_before_its_first_time_reading():
    # psutil's create_time() reads up to 1 s early (whole-second boot time); 0.81 s on the dev machine.
    child = subprocess.Popen([sys.executable, "-S", "-c", "import time; print(repr(time.time()), flush=True); "
                              "time.sleep(30)"], stdout=subprocess.PIPE, text=True)
    try:
        first_reading = float(child.stdout.readline())
        started = process_started_at(child.pid)
    finally:
        child.kill()
        child.wait()
    assert 0 <= first_reading - started < 0.5  # Python -S starts in tens of ms; the clock ticks are 10 ms


def test_this_process_started_before_now():
    assert process_started_at() < time.time()
