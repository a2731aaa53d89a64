"""Which threads wake a given thread, from an strace of a process's futex calls: for each wait of that
thread that ended woken (returned 0), the last other thread that had woken a waiter on the same futex.
A Python thread woken by another Python thread's futex wake is most often handed the GIL by it.

    strace -f -p PID -e trace=futex -tt -o TRACE & sleep 3; kill %1
    for t in /proc/PID/task/*; do echo "$(basename $t) $(cat $t/comm)"; done > NAMES
    python bench/futex_wakers.py TRACE TID NAMES
"""
from __future__ import annotations

import collections
import re
import sys


def wakers(trace_path: str, tid: str, names: dict[str, str]) -> tuple[collections.Counter, int]:
    pending: dict[str, tuple[str, str]] = {}  # thread -> (futex address, operation) of an unfinished call
    last_wake: dict[str, str] = {}  # futex address -> the thread that last woke a waiter on it
    by_waker: collections.Counter = collections.Counter()
    woken = 0
    for line in open(trace_path):
        match = re.match(r"(\d+)\s+(\S+)\s+(.*)", line)
        if not match:
            continue
        thread, rest = match.group(1), match.group(3)
        call = re.match(r"futex\((0x[0-9a-f]+), (FUTEX_\w+)", rest)
        if call:
            if "<unfinished" in rest:
                pending[thread] = call.groups()
                continue
            address, operation = call.groups()
        elif "<... futex resumed>" in rest and thread in pending:
            address, operation = pending.pop(thread)
        else:
            continue
        result = re.search(r"= (-?\d+)", rest)
        returned = int(result.group(1)) if result else None
        if "WAKE" in operation and returned and returned >= 1:
            last_wake[address] = thread
        if "WAIT" in operation and thread == tid and returned == 0:
            woken += 1
            waker = last_wake.get(address)
            by_waker[f"{names.get(waker, '?')} ({waker})" if waker else "not seen"] += 1
    return by_waker, woken


def main() -> None:
    trace_path, tid = sys.argv[1], sys.argv[2]
    names = dict(line.split(None, 1) for line in open(sys.argv[3]).read().splitlines()) if len(sys.argv) > 3 else {}
    by_waker, woken = wakers(trace_path, tid, names)
    print(f"thread {tid} ({names.get(tid, '?')}): {woken} waits ended woken")
    for waker, count in by_waker.most_common(10):
        print(f"{count:7d}  {waker}")


if __name__ == "__main__":
    main()
