"""Trace how fast one CPU of this machine runs a fixed piece of pure Python, over time.

    taskset -c 15 python bench/speed_monitor.py OUT.csv &     # until killed
    python bench/speed_monitor.py OUT.csv --analyse THROUGHPUT.csv   # beside bench.py's pairs

Each sample times 200,000 loop iterations (several ms), then sleeps 40 ms, so that the monitor takes
about a sixth of one CPU; a line per sample: epoch seconds at its middle, ms it took. `--analyse` adds to
each pair of bench/bench.py's throughput table the monitor's median ms over each run's timed steps and
the samples/s ratio corrected by them (each run's samples/s times its monitor ms, over the other's).

On the lent GPU VMs (bench/results/host-speed-h200x1) it showed each vCPU switching on its own between
two speeds about 1.8x apart within a second; so a monitor on one CPU does not follow a run on another
(r = 0.08 and 0.31 there), and the correction does not hold there. It holds only where the machine's
speed changes as a whole.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ray_zero.speed_probe import python_loop  # noqa: E402

LOOP = 200_000


def monitor(path: Path) -> None:
    with path.open("a", buffering=1) as out:
        while True:
            started = time.perf_counter()
            python_loop(LOOP)
            took = time.perf_counter() - started
            out.write(f"{time.time() - took / 2:.3f},{took * 1e3:.3f}\n")
            time.sleep(0.04)


def analyse(trace: Path, table: Path) -> None:
    import pandas as pd

    samples = pd.read_csv(trace, names=["t", "ms"])
    runs = pd.read_csv(table)

    def median_ms(start: float, end: float) -> float:
        window = samples[(samples.t >= start) & (samples.t <= end)]
        return float(window.ms.median()) if len(window) else float("nan")

    for side in ("bare", "ray_zero"):
        runs[f"{side}_monitor_ms"] = [median_ms(a, b) for a, b in zip(runs[f"{side}_timed_from"],
                                                                       runs[f"{side}_timed_to"])]
    runs["monitor_ratio"] = runs["ray_zero_monitor_ms"] / runs["bare_monitor_ms"]
    runs["corrected_ratio"] = runs["samples_per_s_ratio"] * runs["monitor_ratio"]
    columns = ["repeat", "first", "bare_samples_per_s", "ray_zero_samples_per_s", "samples_per_s_ratio",
               "bare_thread_cpu_ms_per_step", "ray_zero_thread_cpu_ms_per_step", "bare_monitor_ms",
               "ray_zero_monitor_ms", "monitor_ratio", "corrected_ratio"]
    print(runs[columns].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    both = pd.DataFrame({"cpu_ms": pd.concat([runs.bare_thread_cpu_ms_per_step,
                                              runs.ray_zero_thread_cpu_ms_per_step]),
                         "monitor_ms": pd.concat([runs.bare_monitor_ms, runs.ray_zero_monitor_ms])})
    print(f"\ncorrelation of a run's training-thread CPU ms a step with the monitor's ms (all runs): "
          f"{both.cpu_ms.corr(both.monitor_ms):.3f}")
    print(f"median ratio {runs.samples_per_s_ratio.median():.3f}, corrected {runs.corrected_ratio.median():.3f}; "
          f"geometric mean {runs.samples_per_s_ratio.prod() ** (1 / len(runs)):.3f}, "
          f"corrected {runs.corrected_ratio.prod() ** (1 / len(runs)):.3f} ({len(runs)} pairs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--analyse", type=Path, metavar="THROUGHPUT_CSV")
    args = parser.parse_args()
    if args.analyse:
        analyse(args.trace, args.analyse)
    else:
        monitor(args.trace)


if __name__ == "__main__":
    sys.exit(main())
