"""The calling thread's CPU cycles and instructions in user space, from Linux's perf events.

Two threads can spend different CPU time on the same work in two ways: one runs more instructions (another
code path), or the same instructions at fewer a cycle (a busy core sibling, caches, a lower clock). These
counts tell them apart. Many VMs and containers offer no hardware counters: `ThreadCounters.open()` is
then None. perf_event_open has no wrapper in Python's standard library; this is the syscall via ctypes.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct

_SYSCALL = {"x86_64": 298, "aarch64": 241}.get(platform.machine())  # __NR_perf_event_open
HARDWARE, CYCLES, INSTRUCTIONS = 0, 0, 1  # PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES, _INSTRUCTIONS
SOFTWARE, TASK_CLOCK = 1, 1  # PERF_TYPE_SOFTWARE, PERF_COUNT_SW_TASK_CLOCK (ns on a CPU): any Linux has it
_EXCLUDE_KERNEL, _EXCLUDE_HV = 1 << 5, 1 << 6  # user space only: allowed at perf_event_paranoid 2
_TIME_ENABLED_AND_RUNNING = 1 | 2  # read_format: to scale a count the kernel multiplexed
_ATTR_SIZE = 112  # PERF_ATTR_SIZE_VER5


def open_counter(kind: int, config: int) -> int:
    """A file descriptor counting event (kind, config) for the calling thread, on any CPU."""
    if _SYSCALL is None:
        raise OSError(f"perf events: no syscall number known for {platform.machine()}")
    # struct perf_event_attr: type, size, config, sample_period, sample_type, read_format, flags, ...
    attr = struct.pack("IIQQQQQ", kind, _ATTR_SIZE, config, 0, 0, _TIME_ENABLED_AND_RUNNING,
                       _EXCLUDE_KERNEL | _EXCLUDE_HV).ljust(_ATTR_SIZE, b"\0")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(_SYSCALL, ctypes.create_string_buffer(attr, _ATTR_SIZE), 0, -1, -1, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return fd


def read_counter(fd: int) -> int:
    value, enabled, running = struct.unpack("QQQ", os.read(fd, 24))
    return round(value * enabled / running) if running else 0


class ThreadCounters:
    """Cycles and instructions of the thread that opened them, counted from `open()` until `close()`."""

    def __init__(self, cycles_fd: int, instructions_fd: int):
        self._fds = (cycles_fd, instructions_fd)

    @classmethod
    def open(cls) -> ThreadCounters | None:
        try:
            cycles = open_counter(HARDWARE, CYCLES)
        except OSError:  # no PMU (ENOENT), not allowed (EACCES, EPERM)
            return None
        try:
            return cls(cycles, open_counter(HARDWARE, INSTRUCTIONS))
        except OSError:
            os.close(cycles)
            return None

    def read(self) -> tuple[int, int]:
        """(cycles, instructions) so far."""
        return read_counter(self._fds[0]), read_counter(self._fds[1])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
