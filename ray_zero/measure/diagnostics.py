"""Opt-in figures of the host a rank ran on (`--diagnostics`: diagnostics.csv): when each phase began and
ended on the wall clock, the training thread's CPU time and scheduler counts over the timed steps, the
process and its folders. They diagnose a slow run on a shared machine (bench/bench.md); nothing of this
module runs unless asked for, and none of it runs per step.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil


def process_started_at(pid: Optional[int] = None) -> float:
    """Wall-clock time (as time.time()) at which process `pid` (default: this one) started.

    psutil adds the start (ticks since boot) to /proc/stat's boot time, which Linux rounds down to
    whole seconds: up to 1 s early. The clock less /proc/uptime gives the boot time without it."""
    created = psutil.Process(pid).create_time()
    try:
        with open("/proc/uptime") as uptime:
            booted_at = time.time() - float(uptime.read().split()[0])
    except OSError:  # not Linux: psutil's own figure
        return created
    return booted_at + (created - psutil.boot_time())


def _thread_scheduling() -> Optional[tuple[float, int, int]]:
    """The calling thread's time runnable without a core (s), its voluntary switches (it blocked: on the
    GIL, the device, I/O) and its migrations to another CPU, from Linux's /proc; None elsewhere."""
    folder = Path("/proc/thread-self")
    try:
        run_queue_ns = int((folder / "schedstat").read_text().split()[1])
        status = (folder / "status").read_text()
        sched = (folder / "sched").read_text()
    except (OSError, IndexError, ValueError):
        return None
    voluntary = next(
        int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")
    )
    migrations = next(
        (int(line.split(":")[1]) for line in sched.splitlines() if line.startswith("se.nr_migrations")), 0
    )
    return run_queue_ns / 1e9, voluntary, migrations


def _threads_cpu_s() -> dict[int, float]:
    """CPU time (user + kernel, s) of each live thread of this process (Linux)."""
    ticks, result = os.sysconf("SC_CLK_TCK"), {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        result[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return result


class Diagnostics:
    """Marks and host figures of one rank; `result()` is its row of diagnostics.csv."""

    def __init__(self):
        self.figures: dict[str, Any] = {
            "pid": os.getpid(),
            "process_started_at": process_started_at(),
            "working_dir": os.getcwd(),
            "niceness": os.nice(0),
            "python": sys.executable,
        }
        self._gc_s, self._gc_began = 0.0, None
        self.mark("train_loop_started")  # Ray Train's worker, its process group, set up

    def mark(self, name: str) -> None:
        """`NAME_at`: when a phase ended (time.time(), comparable across processes of a machine)."""
        self.figures[f"{name}_at"] = time.time()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self._gc_s += time.perf_counter() - self._gc_began
            self._gc_began = None

    def start_timed(self) -> None:
        import torch

        self.figures["torch_threads"] = torch.get_num_threads()
        gc.callbacks.append(self._on_gc)
        self._sched, self._threads = _thread_scheduling(), _threads_cpu_s()
        self._thread_cpu = time.thread_time()
        self.mark("warmed_up")

    def stop_timed(self) -> None:
        self.mark("finished")
        self.figures["timed_thread_cpu_s"] = time.thread_time() - self._thread_cpu
        ended = _thread_scheduling()
        if self._sched and ended:
            for key, before, after in zip(
                ("timed_run_queue_s", "timed_voluntary_switches", "timed_thread_migrations"),
                self._sched,
                ended,
            ):
                self.figures[key] = after - before
        me, now = threading.get_native_id(), _threads_cpu_s()
        self.figures["timed_other_threads_cpu_s"] = sum(
            cpu - self._threads.get(tid, 0.0) for tid, cpu in now.items() if tid != me
        )
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self.figures["timed_gc_s"] = self._gc_s

    def result(self) -> dict[str, Any]:
        # Where DeepSpeed's JIT ops were built or found (the rank sets it as it starts training).
        return {**self.figures, "jit_ops_dir": os.environ.get("TORCH_EXTENSIONS_DIR")}
