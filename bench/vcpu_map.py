"""How fast each CPU of this machine runs a fixed pure-Python loop, alone and beside a busy loop on
each other CPU: on a VM, which vCPUs are slow (their host cores shared with someone else's work) and
which pairs slow each other down (hyperthreads of one host core that the VM does not show as such).

    python bench/vcpu_map.py --rounds 3 > vcpu-map.txt

Each figure is the best of three timings of 200,000 loop iterations (ms), in a process pinned to the CPU.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ray_zero.speed_probe import best_ms, python_loop  # noqa: E402

LOOP = 200_000


def _busy(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    while not stop.is_set():
        total = 0
        for i in range(10_000):
            total += i


def _measure_on(cpu: int) -> float:
    os.sched_setaffinity(0, {cpu})
    time.sleep(0.002)  # let the move happen
    return best_ms(lambda: python_loop(LOOP), repeats=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    print("alone, ms per loop, one row per round:")
    print("cpu    " + " ".join(f"{c:>6}" for c in cpus))
    for round_ in range(args.rounds):
        print(f"r{round_:<5} " + " ".join(f"{_measure_on(c):6.2f}" for c in cpus), flush=True)
    print("\nrow: the CPU measured; column: the CPU kept busy; ms per loop (the diagonal: alone)")
    print("cpu    " + " ".join(f"{c:>6}" for c in cpus))
    for measured in cpus:
        row = []
        for busy in cpus:
            if busy == measured:
                row.append(_measure_on(measured))
                continue
            stop = mp.Event()
            worker = mp.Process(target=_busy, args=(busy, stop))
            worker.start()
            time.sleep(0.05)
            row.append(_measure_on(measured))
            stop.set()
            worker.join()
        print(f"{measured:<6} " + " ".join(f"{v:6.2f}" for v in row), flush=True)


if __name__ == "__main__":
    main()
