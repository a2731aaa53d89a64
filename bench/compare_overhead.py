"""Per-trial overhead of two code versions from their bench/bench.py runs: old against new.

    python bench/compare_overhead.py --old /tmp/old-1 /tmp/old-2 ... --new /tmp/new-1 /tmp/new-2 ...

Each argument is a bench.csv or the folder that holds one. Only trials after a sweep's first
(order_in_sweep >= 2) count: what a trial adds to a running sweep, measured from the previous trial's row
to its own the same way by both versions (a first trial's overhead is measured from different starts).
Per worker count and side: the median and spread of `ray_zero_overhead_s` (wall time beyond the timed
steps) and of `overhead_minus_bare_s` (the same less bare torchrun's, run just before in the same
invocation); then new - old: the difference of the medians and, over every pair of one new and one old
trial, the median difference with its 10th-90th percentiles (the Hodges-Lehmann shift and its spread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import pandas as pd

FIGURES = {"ray_zero_overhead_s": "+.2f", "overhead_minus_bare_s": "+.2f", "samples_per_s_ratio": ".3f"}
"""The figures compared, with their format (seconds; the ratio ray_zero / bare of samples/s)."""


def read(paths: list[Path]) -> pd.DataFrame:
    frames = []
    for run, path in enumerate(paths, 1):
        frame = pd.read_csv(path / "bench.csv" if path.is_dir() else path)
        if "order_in_sweep" not in frame:
            print(
                f"compare_overhead: {path} has no order_in_sweep column (an older bench.csv): left out",
                file=sys.stderr,
            )
            continue
        # The earlier bench.csv has no num_workers column: the trial name ends in _w<N>.
        frame["num_workers"] = frame["trial"].str.extract(r"_w(\d+)", expand=False).astype(int)
        frames.append(frame.assign(run=run))
    table = pd.concat(frames, ignore_index=True)
    return table[table["order_in_sweep"] >= 2]


def spread(values: list[float], f: str) -> str:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return (
        f"{statistics.median(values):{f}}  (quartiles {q[0]:{f}} .. {q[2]:{f}}, "
        f"range {min(values):{f}} .. {max(values):{f}}, n={len(values)})"
    )


def shift(new: list[float], old: list[float]) -> str:
    differences = sorted(a - b for a in new for b in old)
    deciles = (
        statistics.quantiles(differences, n=10, method="inclusive")
        if len(differences) > 1
        else differences * 9
    )
    return f"{statistics.median(differences):+.3f}  (10th-90th percentile {deciles[0]:+.3f} .. {deciles[-1]:+.3f})"  # noqa: E501


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--old", type=Path, nargs="+", required=True, help="bench.csv files (or folders) of the old code"
    )
    parser.add_argument(
        "--new", type=Path, nargs="+", required=True, help="bench.csv files (or folders) of the new code"
    )
    args = parser.parse_args()
    old, new = read(args.old), read(args.new)
    print(
        f"trials after a sweep's first: old {len(old)} from {old['run'].nunique()} runs, new {len(new)} from "
        f"{new['run'].nunique()} runs; medians in seconds (samples_per_s_ratio: ray_zero / bare)"
    )
    for workers in sorted(set(old["num_workers"]) | set(new["num_workers"])):
        o, n = old[old["num_workers"] == workers], new[new["num_workers"] == workers]
        print(
            f"\n{workers} worker{'s' if workers > 1 else ''}: {', '.join(sorted(set(o['trial']) | set(n['trial'])))}"  # noqa: E501
        )
        for figure, f in FIGURES.items():
            print(f"  {figure}")
            if len(o):
                print(f"    old        {spread(list(o[figure]), f)}")
            if len(n):
                print(f"    new        {spread(list(n[figure]), f)}")
            if len(o) and len(n):
                print(
                    f"    new - old  {statistics.median(n[figure]) - statistics.median(o[figure]):+.3f}  "
                    f"(difference of the medians)"
                )
                print(f"    new - old  {shift(list(n[figure]), list(o[figure]))}  (every new-old pair)")


if __name__ == "__main__":
    main()
