"""How often each thread of a process blocks (voluntary context switches a second), and how long it
waits for a core: which threads wake up, and how often, while a rank trains.

    python bench/thread_wakes.py PID [SECONDS] [--top N]

Linux only (/proc). Prints one line per thread that blocked or waited, most wake-ups first; the
process's main thread is marked.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ray_zero.metrics import thread_name, thread_scheduling  # noqa: E402


def snapshot(pid: int) -> dict[int, tuple[str, tuple[float, int]]]:
    threads = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        name, counts = thread_name(tid, pid), thread_scheduling(tid, pid)
        if name is not None and counts is not None:  # else the thread ended
            threads[tid] = (name, counts)
    return threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("seconds", type=float, nargs="?", default=5.0)
    parser.add_argument("--top", type=int, default=None, help="only the N threads that blocked most")
    args = parser.parse_args()
    before = snapshot(args.pid)
    time.sleep(args.seconds)
    after = snapshot(args.pid)
    rows = []
    for tid in before.keys() & after.keys():
        name, (queue_before, blocks_before) = before[tid]
        _, (queue_after, blocks_after) = after[tid]
        rows.append(((blocks_after - blocks_before) / args.seconds, tid, name,
                     100 * (queue_after - queue_before) / args.seconds))
    for wakes, tid, name, queue in sorted(rows, reverse=True)[:args.top]:
        if wakes or queue:
            name += " (main)" if tid == args.pid else ""
            print(f"{tid:>8} {name:25s} blocked {wakes:7.1f} times a second, waited for a core {queue:5.2f} %")


if __name__ == "__main__":
    main()
