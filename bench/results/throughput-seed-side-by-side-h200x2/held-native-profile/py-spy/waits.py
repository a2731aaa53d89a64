"""Shares of the training loop's py-spy samples (raw, --native) by the loop's line, and the share in which
the training thread waited inside backward for torch's autograd device thread (ReadyQueue::pop).
    python bench/results/throughput-seed-side-by-side-h200x2/held-native-profile/py-spy/waits.py
"""
import collections
import gzip
from pathlib import Path

for name in ("bare", "ray_zero"):
    lines, waiting, total = collections.Counter(), 0, 0
    for row in gzip.open(Path(__file__).parent / f"{name}.txt.gz", "rt"):
        stack, _, count = row.rstrip().rpartition(" ")
        frames, count = stack.split(";"), int(count)
        loop = [f for f in frames if f.startswith("_train (ray_zero/worker.py:")]
        if not loop or not 195 <= int(loop[0].rsplit(":", 1)[1].rstrip(")")) <= 245:
            continue  # outside the training loop (start-up, the other threads)
        total += count
        lines[int(loop[0].rsplit(":", 1)[1].rstrip(")"))] += count
        if "ReadyQueue::pop" in stack and "execute_with_graph_task" in stack and "pthread_cond_wait" in stack:
            waiting += count
    print(f"{name}: {total} samples in the loop; waiting in backward for the autograd thread {waiting / total:.1%}; "
          f"by line: {', '.join(f'{k}: {v / total:.1%}' for k, v in sorted(lines.items()) if v / total >= 0.01)}")
