"""When a process started, on the wall clock that every other mark (time.time()) uses.

psutil's `create_time()` adds a process's start (clock ticks since boot) to the boot time in
/proc/stat, which Linux gives in whole seconds, rounded down: every process reads up to 1 s early, by
the same amount on one machine until it reboots (0.81 s on the 2-core CPU machine, 2026-12-01). A
phase that starts at such a mark and ends at a time.time() one came out that much too long: the start
of a sweep's first trial (Tune's driver process) and a rank's process start. The boot time here is
the clock now less /proc/uptime (10 ms), the kernel's own computation without the rounding.
"""
from __future__ import annotations

import time
from typing import Optional

import psutil


def process_started_at(pid: Optional[int] = None) -> float:
    """Wall-clock time (as time.time()) at which process `pid` (default: this one) started."""
    created = psutil.Process(pid).create_time()
    try:
        with open("/proc/uptime") as uptime:
            booted_at = time.time() - float(uptime.read().split()[0])
    except OSError:  # not Linux: psutil's own figure
        return created
    return booted_at + (created - psutil.boot_time())  # since boot: exact, both use /proc/stat's boot time
