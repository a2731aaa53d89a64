"""A sweep with trials side by side on a GPU against one trial per GPU at a time: same experiment, same
machine, alternating.

    python bench/sweep_bench.py experiments/gpt2_zero.yaml --old /tmp/sweep_old --pairs 2 --output OUT
    python bench/sweep_bench.py experiments/quick.yaml --pairs 3 --output OUT        # CPU: the same code
    python bench/sweep_bench.py --summarize --output OUT                              # the table again

Each run is `python -m ray_zero sweep EXPERIMENT --output DIR` in a fresh process, as a user runs it,
timed from process start to exit. "old" is the checkout --old (e.g. `git worktree add /tmp/sweep_old
HEAD~1`: today's scheduling as it was) or, without --old, this checkout with
`--set runtime.share_gpus=false` (one trial per GPU, +1 starting early); "new" is this checkout as it
is. Which goes first alternates from pair to pair (the machines' speed drifts); a later call with the
same --output adds pairs. `--old-set runtime.overlap_startup=false` makes the old side strictly one at a
time. Printed, and written to OUT/sweep_bench.md: each run's wall time, the ratios of the pairs, per
trial each side's status, peak allocated (GiB, median over its runs), their difference, samples/s
(median), how far apart each side's own runs lie, and the ratio (judged over the grid's points: a
calibration trial times 2 steps); how many measuring windows of two trials on one GPU overlapped in the
new runs (none should: ray_zero/train/turn.py); per run on GPUs, where the time from the first set-up to
the last measuring went (set-up, measuring, the GPU idle between turns); with --gpu-log, the GPU's clock
and utilization inside each point's timed windows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import gpu_log
import pandas as pd
import turn_marks
from common import ROOT

sys.path.insert(0, str(ROOT))

from ray_zero.config import is_calibration  # noqa: E402
from ray_zero.report.frame import markdown_table  # noqa: E402
from ray_zero.store import load_trials, read_provenance  # noqa: E402

PROVENANCE = ("date", "python", "torch", "deepspeed", "ray", "driver_gpus", "cpu")
WALLS = "walls.jsonl"
"""One line per run: its pair, side and wall time (a later call adds pairs to the same folder)."""
PEAK_TOLERANCE = (0.005, 32 / 1024)
"""Peaks agree within 0.5 % or 32 MiB (GiB), whichever is larger (issue 41's rule)."""
RATE_TOLERANCE = 0.10
"""A point's samples/s agrees with its one-at-a-time value within 10 % (issues 41 and 53)."""


def run_sweep(code: Path, experiment: Path, output: Path, overrides: list[str]) -> float:
    """One `python -m ray_zero sweep` from the checkout `code`; its wall time in seconds."""
    command = [sys.executable, "-m", "ray_zero", "sweep", str(experiment), "--output", str(output)]
    for override in overrides:
        command += ["--set", override]
    # That checkout on PYTHONPATH in place of this one (scripts/gpu-env.sh puts this one there), or Ray's
    # workers of the other sweep would import this checkout's ray_zero.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [str(code) if p == str(ROOT) else p for p in paths] or [str(code)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (output.parent / f"{output.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        print(f"{output.name}: exit {done.returncode}; see {output.parent / (output.name + '.log')}")
    return wall


def _rows(folder: Path) -> dict[str, dict]:
    return {row["trial"]: row for row in load_trials(folder)} if folder.is_dir() else {}


def _median(values: list[Optional[float]]) -> Optional[float]:
    values = [v for v in values if isinstance(v, (int, float)) and v == v]
    return statistics.median(values) if values else None


def compare(runs: dict[str, list[Path]]) -> pd.DataFrame:
    """Per point: status, peak and samples/s of each side (medians over its runs), and how they agree."""
    rows = {side: [_rows(folder) for folder in folders] for side, folders in runs.items()}
    names = sorted({name for side in rows.values() for run in side for name in run})
    table = []
    for name in names:
        entry: dict = {"trial": name}
        for side in ("old", "new"):
            mine = [run[name] for run in rows[side] if name in run]
            entry[f"status_{side}"] = "/".join(sorted({r["status"] for r in mine})) or "-"
            entry[f"peak_gib_{side}"] = _median([r.get("peak_allocated_gib_max") for r in mine])
            rates = [r.get("samples_per_s") for r in mine if r.get("samples_per_s")]
            entry[f"samples_per_s_{side}"] = _median(rates)
            # The same scheduling run again: how far apart its own runs' rates lie (max over min).
            entry[f"spread_{side}"] = max(rates) / min(rates) if len(rates) > 1 else None
        old, new = entry["peak_gib_old"], entry["peak_gib_new"]
        if old is not None and new is not None:
            entry["peak_diff_gib"] = new - old
            entry["peak_agrees"] = abs(new - old) <= max(PEAK_TOLERANCE[0] * old, PEAK_TOLERANCE[1])
        old, new = entry["samples_per_s_old"], entry["samples_per_s_new"]
        entry["samples_per_s_ratio"] = new / old if old and new else None
        table.append(entry)
    return pd.DataFrame(table)


def against_alone(runs: dict[str, list[Path]], points: pd.DataFrame) -> pd.DataFrame:
    """Per run and grid point: samples/s over the alone value, the row's step_spread, and whether the ratio
    is within RATE_TOLERANCE and within that spread (issue 53's rule, judged run by run). A new run is
    judged against the old side's median (`compare`'s); with two or more old runs, each old run against
    the median of the others: the same rule applied to the reference itself."""
    alone = points.set_index("trial")["samples_per_s_old"] if len(points) else pd.Series(dtype=float)
    old_rows = {folder.name: _rows(folder) for folder in runs["old"]}

    def reference(run: str, name: str) -> Optional[float]:
        if run not in old_rows:
            return None if pd.isna(alone.get(name)) else alone[name]
        if len(old_rows) < 2:
            return None
        return _median([rows[name].get("samples_per_s") for other, rows in old_rows.items()
                        if other != run and name in rows])

    table = []
    for folder in runs["new"] + runs["old"]:
        rows = old_rows[folder.name] if folder.name in old_rows else _rows(folder)
        for name, row in sorted(rows.items()):
            rate, spread = row.get("samples_per_s"), row.get("step_spread")
            base = reference(folder.name, name)
            if is_calibration(name) or not rate or not base:
                continue
            ratio = rate / base
            recorded = spread is not None and spread == spread  # none in a folder from before issue 53
            table.append(
                {
                    "run": folder.name,
                    "trial": name,
                    "samples_per_s": rate,
                    "alone": base,
                    "ratio": round(ratio, 3),
                    "step_spread": spread,
                    "timing_unstable": row.get("timing_unstable"),
                    "within_10pct": abs(ratio - 1) <= RATE_TOLERANCE,
                    "within_spread": abs(ratio - 1) <= spread if recorded else None,
                }
            )
    return pd.DataFrame(table)


def _counts(table: pd.DataFrame, column: str) -> str:
    groups = table.groupby("run", sort=False)
    judged = {run: g[column].dropna() for run, g in groups}  # None: not judged
    return ", ".join(f"{run} {int(j.astype(bool).sum())} of {len(j)}" for run, j in judged.items())


def summary(output: Path, command: str, old_label: Optional[str] = None) -> str:
    """The comparison of every run recorded in `output` (walls.jsonl and the run folders); the old side
    named `old_label`, else from what its runs recorded (only this checkout's old side sets share_gpus)."""
    walls = [json.loads(line) for line in (output / WALLS).read_text().splitlines() if line.strip()]
    pairs: dict[int, dict] = {}
    for run in walls:
        entry = pairs.setdefault(run["pair"], {"pair": run["pair"], "first": run["side"]})
        entry[f"{run['side']}_wall_s"] = run["wall_s"]
        if run["side"] == "new" and run.get("set"):
            entry["new_set"] = " ".join(run["set"])
    for entry in pairs.values():
        if "old_wall_s" in entry and "new_wall_s" in entry:
            entry["ratio"] = round(entry["new_wall_s"] / entry["old_wall_s"], 3)
    walls_frame = pd.DataFrame(sorted(pairs.values(), key=lambda e: e["pair"]))
    runs = {side: sorted(output.glob(f"{side}-*/")) for side in ("old", "new")}
    sets = {side: {o for r in walls if r["side"] == side for o in r.get("set", [])} for side in runs}
    if old_label is None:
        ours = "runtime.share_gpus=false" in sets["old"]
        old_label = "this checkout, one trial per GPU" if ours else "another checkout (--old)"
    points = compare(runs)
    provenance = next((read_provenance(f) for f in runs["new"] if read_provenance(f)), None) or {}
    # The grid's points: a calibration trial measures memory only, its rate is 2 timed steps (~0.1 s).
    grid = points[~points["trial"].map(is_calibration)] if len(points) else points
    ratios = grid["samples_per_s_ratio"].dropna() if len(grid) else pd.Series(dtype=float)
    within = int(((ratios - 1).abs() <= RATE_TOLERANCE).sum())
    agree = points["peak_agrees"].dropna() if "peak_agrees" in points else pd.Series(dtype=bool)
    overlaps = sum(len(turn_marks.measuring_overlaps(folder)) for folder in runs["new"])
    wall_ratios = walls_frame["ratio"].dropna() if "ratio" in walls_frame else pd.Series(dtype=float)
    lines = [
        f"# sweep_bench: {output.name}",
        "",
        "- " + ", ".join(f"{k}: {provenance[k]}" for k in PROVENANCE if k in provenance),
        f"- command: {command}",
        f"- old: {old_label}",
        "- each side's --set, as run: "
        + "; ".join(f"{side}: " + (" ".join(sorted(sets[side])) or "-") for side in ("old", "new")),
        "",
        markdown_table(walls_frame, list(walls_frame.columns)),
        "",
        "Wall time, new over old: "
        + (f"median {wall_ratios.median():.3f} of {len(wall_ratios)} pairs" if len(wall_ratios) else "-"),
        "",
        markdown_table(points, list(points.columns)) if len(points) else "(no rows)",
        "",
        f"Peaks within 0.5 % or 32 MiB: {int(agree.sum())} of {len(agree)} trials; samples/s new over old, "
        "the grid's points (calibration trials measure memory only): "
        + (
            f"median {ratios.median():.3f} ({ratios.min():.3f}-{ratios.max():.3f}), "
            f"{within} of {len(ratios)} within 10 %"
            if len(ratios)
            else "-"
        )
        + f"; trials that measured while another measured or set up on their GPU (new runs): {overlaps}",
    ]
    timeline = turn_marks.turn_timeline(runs)
    if len(timeline):
        lines += [
            "",
            "From the ranks' marks: first set-up to first measuring, measuring windows added up, the GPU "
            "idle between one window and the next, and the span from first set-up to last window's end (s)",
            "",
            markdown_table(timeline, list(timeline.columns)),
        ]
    against = against_alone(runs, points)
    if len(against):
        lines += [
            "",
            "Each run's grid points against the alone value (the old side, strictly alone with "
            "`--old-set runtime.overlap_startup=false --old-set runtime.max_trials_per_gpu=1`): a new run "
            "against the old side's median, an old run against its other runs' median (the rule applied to "
            "the reference itself); samples/s ratio, the row's own step_spread (interquartile range over "
            "median), and whether the ratio is within 10 % and within that spread",
            "",
            markdown_table(against, list(against.columns)),
            "",
            "Within 10 %: " + _counts(against, "within_10pct") + "; within own spread: "
            + _counts(against, "within_spread"),
        ]
    gpu = gpu_log.timed_window(runs, gpu_log.read(output))
    if len(gpu):
        lines += [
            "",
            "nvidia-smi inside the grid's timed windows (every 250 ms; --gpu-log): lowest SM clock (MHz), "
            "median utilization (%)",
            "",
            markdown_table(gpu, list(gpu.columns)),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", type=Path, nargs="?")
    parser.add_argument("--old", type=Path, help="a checkout of the scheduling to compare against")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--old-set", dest="old_overrides", action="append", default=[],
        help="an override for the old side only, e.g. runtime.overlap_startup=false: strictly one at a time",
    )
    parser.add_argument(
        "--new-set", dest="new_overrides", action="append", default=[],
        help="an override for the new side only (a setting the old checkout does not have)",
    )
    parser.add_argument(
        "--only", choices=("old", "new"),
        help="run this side only (e.g. a second new run against the alone run already in --output)",
    )
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument(
        "--gpu-log", action="store_true",
        help="sample the GPU's clock and utilization with nvidia-smi while the runs go (OUT/gpu_log*.csv)",
    )
    parser.add_argument(
        "--summarize", action="store_true", help="no runs: the comparison of those in --output"
    )
    args = parser.parse_args(argv)
    output = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    old_label = None  # --summarize: from what the runs recorded
    if args.old or not args.summarize:
        old_label = f"the checkout {args.old}" if args.old else "this checkout, runtime.share_gpus=false"
        old_label += "".join(f", {o}" for o in args.old_overrides)
    command = "python bench/sweep_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if not args.summarize:
        experiment = args.experiment.resolve()
        old_code = args.old.resolve() if args.old else ROOT
        old_overrides = args.overrides + ([] if args.old else ["runtime.share_gpus=false"])
        old_overrides += args.old_overrides
        sides = {"old": (old_code, old_overrides), "new": (ROOT, args.overrides + args.new_overrides)}
        recorded = output / WALLS
        done = [json.loads(line) for line in recorded.read_text().splitlines()] if recorded.is_file() else []
        first_pair = max((run["pair"] for run in done), default=0) + 1
        sampler = None
        if args.gpu_log:
            if shutil.which("nvidia-smi") is None:
                parser.error("--gpu-log needs nvidia-smi on PATH (a machine with an NVIDIA GPU)")
            sampler = gpu_log.sample(output / f"gpu_log_pair{first_pair}.csv")
        for pair in range(first_pair, first_pair + args.pairs):  # a later call goes on numbering
            for side in ("old", "new") if pair % 2 else ("new", "old"):
                if args.only and side != args.only:
                    continue
                code, overrides = sides[side]
                wall = run_sweep(code, experiment, output / f"{side}-{pair}", overrides)
                with open(recorded, "a") as record:
                    entry = {"pair": pair, "side": side, "wall_s": round(wall, 1), "set": overrides}
                    record.write(json.dumps(entry) + "\n")
                print(f"pair {pair}: {side} {wall:.1f} s", flush=True)
        if sampler is not None:
            sampler.terminate()
    text = summary(output, command, old_label)
    (output / "sweep_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
