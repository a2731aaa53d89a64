"""Speed at N workers predicted from one worker's row, against what N workers measured (issue 44).

    python bench/speed_bench.py --output OUT                       # CPU: bandwidth, sweep, prediction
    python bench/speed_bench.py --measured DIR1 --against DIR2 --busbw 360 --output OUT   # e.g. H200 rows

Without --measured it runs, in fresh processes as a user would, `python -m ray_zero bandwidth` on 2
workers (gloo on CPU, up to --max-mib) and `python -m ray_zero sweep experiments/speed_cpu.yaml` (every
engine and stage at 1 and 2 workers), each skipped when OUT already has it. Then, for each engine, stage
and micro-batch, the speed model (ray_zero/measure/speed_model.py) predicts the 2-worker samples/s from
the 1-worker row's forward, backward and optimizer time and the bandwidth, and prints it beside the
measured 2-worker row: the point estimate, the band (no overlap to full overlap) and the error.
--against DIR takes the measured rows at the larger worker counts from another folder (rows measured
before the step split, e.g. results/memory_scaling-h200x2, predicted from a 1-worker folder that has it).
Printed, and written to OUT/speed_bench.md with the hardware, versions, date and command.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT

sys.path.insert(0, str(ROOT))

from ray_zero.api import describe, experiment_of  # noqa: E402
from ray_zero.measure.bandwidth import given, read_bandwidth  # noqa: E402
from ray_zero.report.frame import markdown_table  # noqa: E402
from ray_zero.report.speed_estimate import speed_table  # noqa: E402
from ray_zero.store import load_trials, read_experiment_file, read_provenance  # noqa: E402

PROVENANCE = ("date", "python", "torch", "deepspeed", "ray", "driver_gpus", "cpu")


def run(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"speed_bench: {' '.join(command)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - started


def _rescaled(row: dict, truth: list[dict]) -> dict:
    """`row` with its step split scaled to the samples/s `truth` measured at the same point."""
    same = [t for t in truth if t["trial"] == row["trial"] and t.get("samples_per_s")]
    if not same or not row.get("samples_per_s"):
        return row
    factor = row["samples_per_s"] / same[0]["samples_per_s"]
    times = ("forward_s", "backward_s", "optimizer_s", "exposed_comm_s", "step_s")
    return {
        **row,
        **{k: row[k] * factor for k in times if row.get(k) is not None},
        "samples_per_s": same[0]["samples_per_s"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--experiment", default="experiments/speed_cpu.yaml")
    parser.add_argument("--max-mib", type=int, default=64, help="bandwidth's largest message (CPU: 64)")
    parser.add_argument("--measured", type=Path, help="a sweep folder whose rows have the step split")
    parser.add_argument("--against", type=Path, help="a folder whose larger-N rows are the measured truth")
    parser.add_argument("--busbw", type=float, help="GB/s, in place of a measured bandwidth file")
    parser.add_argument(
        "--rates-from-against",
        action="store_true",
        help="scale each measured row's split to --against's samples/s at the same point (rows measured on "
        "another day or machine: the split's shares, the truth's own speed)",
    )
    args = parser.parse_args(argv)
    output = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    if args.busbw:
        bandwidth = given(args.busbw)
    else:
        file = output / "bandwidth.json"
        if not file.is_file():
            command = [python, "-m", "ray_zero", "bandwidth", "--workers", "2", "--device", "cpu"]
            wall = run(
                command + ["--max-mib", str(args.max_mib), "--output", str(file)], output / "bandwidth.log"
            )
            print(f"bandwidth: {wall:.1f} s")
        bandwidth = read_bandwidth(file)
    measured = args.measured.resolve() if args.measured else output / "sweep"
    if not args.measured and not (measured / "trials.jsonl").is_file():
        wall = run(
            [python, "-m", "ray_zero", "sweep", args.experiment, "--output", str(measured)],
            output / "sweep.log",
        )
        print(f"sweep: {wall:.1f} s")
    saved = read_experiment_file(measured)
    experiment = experiment_of(saved["experiment"])
    model = describe(experiment, check_machine=False)
    rows = load_trials(measured)
    mine = {int(r["num_workers"]) for r in rows if r.get("status") == "ok"}
    if args.against:
        truth = load_trials(args.against)
        if args.rates_from_against:
            rows = [_rescaled(row, truth) for row in rows]
        rows += [r for r in truth if int(r["num_workers"]) not in mine]
    targets = sorted({int(r["num_workers"]) for r in rows if r.get("status") == "ok"} - {min(mine)})
    table = speed_table(
        rows, model, targets, bandwidth, experiment.reduce_bucket_size, experiment.gradient_accumulation_steps
    )
    table = table[table["workers"].isin(targets) & table["measured"].notna()]
    provenance = read_provenance(measured) or {}
    errors = table["error"].abs()
    lines = [
        f"# speed_bench: {output.name}",
        "",
        "- measured rows: " + ", ".join(f"{k}: {provenance[k]}" for k in PROVENANCE if k in provenance),
        f"- measured in {measured}" + (f"; larger-N rows from {args.against}" if args.against else ""),
        f"- bandwidth: {bandwidth.source}",
        "- command: python bench/speed_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "",
        markdown_table(table.round(4), list(table.columns)),
        "",
        f"|error|: median {errors.median():.3f}, largest {errors.max():.3f}, {int((errors <= 0.25).sum())} "
        f"of {len(errors)} within 25 %",
    ]
    text = "\n".join(lines)
    (output / "speed_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
