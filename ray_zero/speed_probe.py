"""How fast this process runs fixed work that has nothing to do with training: a diagnosis, off unless
RAY_ZERO_SPEED_PROBE=1 (set it where bench/bench.py runs: the ranks of both launchers inherit it).

On the lent GPU VMs a host-bound step's CPU time varies by whole runs (bare alone 1.23x between runs of
one call), and over many pairs a Ray rank was a few per cent slower (bench/README.md, "Still open").
Run in the thread that trained, right after the timed steps, these tell a process that runs everything
slower (the same figures slow too) from one whose training alone is slower, and which resource it is:

- python_loop_ms: a pure-Python loop (the interpreter, in the core's caches);
- dispatch_us: one small torch CPU op (torch's dispatcher, as a host-bound step's launches);
- gather_ms: random reads over 256 MiB of this process's memory (memory latency: where its pages lie);

each the best of five, in ms (us for one op). Also the process's memory in transparent huge pages,
and its resident size. On the lent H200 VMs the loop fell into two groups, about 30 and 45-68 ms, in
ranks and plain processes alike, and the training thread's CPU time a step moved with it: each vCPU
switches between two speeds (bench/results/host-speed-h200x1).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "RAY_ZERO_SPEED_PROBE"


def wanted() -> bool:
    return os.environ.get(ENV) == "1"


def best_ms(work, repeats: int = 5) -> float:
    """The shortest of `repeats` timings of `work()`, in ms."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def python_loop(iterations: int = 1_000_000) -> None:
    """Fixed pure-Python work: the interpreter alone, in the core's caches (no torch: the bench's CPU
    tracers, bench/speed_monitor.py and bench/vcpu_map.py, time it too)."""
    total = 0
    for i in range(iterations):
        total += i


def _smaps_rollup_mib() -> dict[str, float | None]:
    """The process's resident memory and its part in transparent huge pages, from Linux's /proc."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return {"rss_mib": None, "anon_huge_mib": None}
    kib = {line.split(":")[0]: int(line.split()[1]) for line in lines[1:] if line.endswith("kB")}
    return {"rss_mib": kib.get("Rss", 0) / 1024, "anon_huge_mib": kib.get("AnonHugePages", 0) / 1024}


def measure() -> dict[str, float | None]:
    """The figures above, prefixed probe_; about 1 s of this thread's time."""
    import torch  # here: the loop above serves processes without torch

    small = torch.ones(16)
    ops = 2_000

    def dispatch() -> None:
        for _ in range(ops):
            torch.add(small, 1.0)

    memory = torch.arange(32 * 2**20, dtype=torch.int64)  # 256 MiB, touched
    generator = torch.Generator().manual_seed(0)
    indices = torch.randint(0, memory.numel(), (2 * 2**20,), generator=generator)
    figures = {
        "python_loop_ms": best_ms(python_loop),
        "dispatch_us": best_ms(dispatch) * 1e3 / ops,
        "gather_ms": best_ms(lambda: memory[indices].sum()),
        **_smaps_rollup_mib(),
    }
    del memory, indices
    return {f"probe_{name}": value for name, value in figures.items()}
