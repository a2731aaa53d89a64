"""One-worker rows measured as an N-worker run loads the host: each point run as N one-worker sweeps at
once, side by side on one local Ray cluster (issue 44, CPU).

    python bench/speed_twins.py --output OUT/twins_w1 [--experiment experiments/speed_cpu.yaml] [--copies 2]
    python bench/speed_bench.py --measured OUT/twins_w1 --against OUT/sweep --output OUT   # then predict

On a CPU machine N ranks share the cores: at 2 ranks on 2 vCPUs each rank's forward and backward took
17-51 % longer than one rank alone (bench/speed_bench.md). A one-worker row measured alone cannot know
that; measured beside another trial of a different engine, it learns a neighbour's load, not its own.
Here every engine and stage of the experiment runs as `--copies` identical one-worker sweeps started
together (`python -m ray_zero sweep ... --address` the Ray cluster this script holds), so each
copy computes beside its own twin, as each rank of the N-worker run does. The folder written holds one
row per point: the first copy's row with its step split and samples/s the mean of the copies'. Printed:
each point's copies' samples/s and how much of their measuring windows overlapped (per_rank
measuring_from/until); a pair that did not overlap measured nothing this script is for.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from subprocess import DEVNULL, PIPE

import ray
from common import ROOT

sys.path.insert(0, str(ROOT))

from ray_zero.experiment_file import load_experiment  # noqa: E402
from ray_zero.run.plan import Cluster, plan_sweep  # noqa: E402
from ray_zero.store import EXPERIMENT_FILE, append_trial, load_trials  # noqa: E402

SPEED = ("forward_s", "backward_s", "optimizer_s", "exposed_comm_s", "step_s", "samples_per_s")
"""The fields speed_bench's prediction reads, averaged over the copies."""


def overlap(rows: list[dict]) -> float:
    """The fraction of the shortest measuring window during which every copy was measuring."""
    windows = [
        (r["measuring_from"], r["measuring_until"])
        for row in rows
        for r in row.get("per_rank") or []
        if r.get("measuring_from") and r.get("measuring_until")
    ]
    if len(windows) < len(rows):
        return 0.0
    common = min(until for _, until in windows) - max(start for start, _ in windows)
    return max(common, 0.0) / min(until - start for start, until in windows)


def merged(rows: list[dict]) -> dict:
    """The first copy's row, its speed fields the mean of every copy's."""
    row = dict(rows[0])
    for key in SPEED:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        row[key] = statistics.fmean(values) if len(values) == len(rows) else None
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="the folder of merged one-worker rows")
    parser.add_argument("--experiment", default="experiments/speed_cpu.yaml")
    parser.add_argument("--copies", type=int, default=2, help="one-worker sweeps side by side (N to mimic)")
    args = parser.parse_args(argv)
    output = args.output.resolve()
    if (output / "trials.jsonl").is_file():
        sys.exit(f"speed_twins: {output} already holds rows; give a new --output")
    copies_dir = output.parent / f"{output.name}_copies"
    experiment = load_experiment(args.experiment)
    plan = plan_sweep(experiment, Cluster(gpus=0, cpus=2 * args.copies, source="speed_twins"))
    points = list(dict.fromkeys((p.backend, p.stage, p.micro_batch_size) for p in plan.runnable))
    # This process holds the cluster the copies join; it stops with this script, touching no other Ray.
    address = ray.init(num_cpus=2 * args.copies, include_dashboard=False).address_info["gcs_address"]
    output.mkdir(parents=True)
    try:
        for backend, stage, micro in points:
            name = f"{backend}_{stage}_mb{micro}"
            runs = [copies_dir / f"{name}_{i}" for i in range(args.copies)]
            command = [
                sys.executable, "-m", "ray_zero", "sweep", args.experiment, "--address", address, "--quiet",
                "--set", f"grid.backend=[{backend}]", "--set", f"grid.stage=[{stage}]",
                "--set", f"grid.micro_batch_size=[{micro}]", "--set", "grid.num_workers=[1]",
            ]  # fmt: skip
            started = time.perf_counter()
            procs = [
                subprocess.Popen(command + ["--output", str(run)], cwd=ROOT, stdout=DEVNULL, stderr=PIPE)
                for run in runs
            ]
            failed = [p.stderr.read().decode()[-300:] for p in procs if p.wait() != 0]
            if failed:
                sys.exit(f"speed_twins: {name}: a copy failed: {failed[0]}")
            rows = [next(r for r in load_trials(run) if r.get("status") == "ok") for run in runs]
            append_trial(output, merged(rows))
            speeds = ", ".join(f"{r['samples_per_s']:.1f}" for r in rows)
            print(
                f"{name}: samples/s {speeds}; windows overlap {overlap(rows):.0%}; "
                f"{time.perf_counter() - started:.0f} s",
                flush=True,
            )
            shutil.copy(runs[0] / EXPERIMENT_FILE, output)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
