"""`fit` against an older `fit`, or against the exhaustive sweep it replaces: same experiment, one machine.

    python bench/fit_bench.py experiments/fit_gpt2_cpu.yaml --old /tmp/fit_old --budgets 1.669,2.035,2.48 \
        --granularity 32 --pairs 3 --output /tmp/fitbench
    python bench/fit_bench.py experiments/fit_gpt2_cpu.yaml --sizes 32,64,96,128 --output /tmp/fitbench

With --old DIR (a checkout of the older code, e.g. `git worktree add /tmp/fit_old 507be71`): for every
budget, `python -m ray_zero fit EXPERIMENT --budget-gib B --granularity G` from DIR and from --new (this
checkout by default), each a fresh process as a user runs it, alternating which goes first from one pair
to the next (the machine's speed drifts); per run its wall time (process start to exit) and its answers
(fit.csv: the largest micro-batch per point, probes, Ray Train runs), then per budget the medians and
whether every run of both gave the same answers. Writes fit_bench.csv and fit_bench.md in --output.

Without --old: first every micro-batch of --sizes for every point of the grid (the exhaustive sweep),
then, for each pair of neighbouring sizes whose peaks leave a gap for every point, a `fit` whose budget
lies midway in that gap; per (budget, point) the exhaustive answer beside fit's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pandas as pd
from common import ROOT

sys.path.insert(0, str(ROOT))

from ray_zero.report.frame import markdown_table  # noqa: E402
from ray_zero.store import load_trials, read_experiment_file  # noqa: E402

POINT = ["backend", "stage", "num_workers", "activation_checkpointing", "offload_optimizer"]
PROVENANCE = ("date", "python", "torch", "deepspeed", "ray", "cpu", "cluster")


def run_cli_fit(
    code: Path,
    experiment: Path,
    budget: Optional[float],
    granularity: int,
    output: Path,
    overrides: list[str],
) -> dict:
    """One `python -m ray_zero fit` from the checkout `code`: its wall time and answers."""
    command = [sys.executable, "-m", "ray_zero", "fit", str(experiment), "--output", str(output)]
    command += ["--budget-gib", str(budget)] if budget is not None else []  # None: fit's default (GPU)
    command += ["--granularity", str(granularity)] if granularity else []
    for override in overrides:
        command += ["--set", override]
    # The checkout in place of this one on PYTHONPATH too (scripts/gpu-env.sh puts this one there), or
    # Ray's workers of the older fit would import this checkout's ray_zero.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(code) if p == str(ROOT) else p for p in paths)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    (output.parent / f"{output.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not (output / "fit.csv").is_file():
        return {
            "wall_s": round(wall, 1),
            "answers": f"failed (exit {done.returncode})",
            "probes": None,
            "runs": None,
        }
    fit = pd.read_csv(output / "fit.csv")
    answers = "; ".join(
        f"stage {int(r['stage'])} w{int(r['num_workers'])}: "
        + ("-" if pd.isna(r["max_micro_batch"]) else str(int(r["max_micro_batch"])))
        for _, r in fit.iterrows()
    )
    # Ray Train runs: distinct over the rows (searches may share one); older fits name none per row.
    named = {r.get("run") for r in load_trials(output)} - {None}
    runs = len(named) if named else int(fit["runs"].sum()) if "runs" in fit else int(fit["probes"].sum())
    return {"wall_s": round(wall, 1), "answers": answers, "probes": int(fit["probes"].sum()), "runs": runs}


def old_against_new(args, experiment: Path) -> pd.DataFrame:
    codes = {"old": args.old.resolve(), "new": args.new.resolve()}
    budgets = [None if b == "default" else float(b) for b in args.budgets.split(",")]
    runs = []
    for pair in range(args.pairs):
        for index, budget in enumerate(budgets):
            order = ["old", "new"] if (pair + index) % 2 == 0 else ["new", "old"]
            for code in order:
                output = args.output / f"{code}-{budget or 'default'}-{pair}"
                found = run_cli_fit(codes[code], experiment, budget, args.granularity, output, args.set)
                runs.append(
                    {
                        "budget_gib": budget or "default",
                        "pair": pair,
                        "code": code,
                        "first": code == order[0],
                        **found,
                    }
                )
                print(
                    f"fit_bench: budget {budget or 'default'}, pair {pair}, {code}: {found['wall_s']} s, "
                    f"{found['answers']}, {found['probes']} probes, {found['runs']} runs",
                    flush=True,
                )
    table = pd.DataFrame(runs)
    table.to_csv(args.output / "fit_bench_runs.csv", index=False)
    summary = []
    for budget, group in table.groupby("budget_gib"):
        old, new = group[group["code"] == "old"], group[group["code"] == "new"]
        summary.append(
            {
                "budget_gib": budget,
                "pairs": len(new),
                "old_wall_s": " ".join(f"{w:.0f}" for w in old["wall_s"]),
                "new_wall_s": " ".join(f"{w:.0f}" for w in new["wall_s"]),
                "old_median_s": statistics.median(old["wall_s"]),
                "new_median_s": statistics.median(new["wall_s"]),
                "new_over_old": round(statistics.median(new["wall_s"]) / statistics.median(old["wall_s"]), 3),
                "answers": " | ".join(sorted(set(group["answers"]))),
                "same_answers": group["answers"].nunique() == 1,
                "old_probes": " ".join(map(str, old["probes"])),
                "new_probes": " ".join(map(str, new["probes"])),
                "new_runs": " ".join(map(str, new["runs"])),
            }
        )
    return pd.DataFrame(summary)


def midway_budgets(peaks: pd.DataFrame, sizes: list[int]) -> list[tuple[int, float]]:
    """(size below the budget, budget) for each neighbouring pair whose gap holds for every point."""
    budgets = []
    for low, high in zip(sizes, sizes[1:]):
        fits, over = peaks.loc[low], peaks.loc[high]
        if fits.max() < over.min():
            budgets.append((low, float(fits.max() + over.min()) / 2))
    return budgets


def against_exhaustive(args, experiment_path: Path) -> pd.DataFrame:
    from ray_zero.experiment_file import load_experiment
    from ray_zero.measure.search import FitSettings
    from ray_zero.models.describe import describe_model
    from ray_zero.run.fit import run_fit
    from ray_zero.run.sweep import run_sweep

    sizes = sorted(int(s) for s in args.sizes.split(","))
    granularity = sizes[1] - sizes[0]
    if any(b - a != granularity for a, b in zip(sizes, sizes[1:])) or sizes[0] != granularity:
        sys.exit(
            f"fit_bench: --sizes {args.sizes}: give multiples of one step from the step itself, e.g. "
            "32,64,96,128"
        )
    started = time.time()
    exhaustive = run_sweep(
        load_experiment(experiment_path, [*args.set, f"grid.micro_batch_size={sizes}"]),
        args.output / "exhaustive",
        command="fit_bench exhaustive",
    )
    exhaustive_s = time.time() - started
    ok = exhaustive[exhaustive["status"] == "ok"]
    peaks = ok.pivot_table(index="micro_batch_size", columns=POINT, values="peak_allocated_gib_max")
    rows = []
    for below, budget in midway_budgets(peaks, sizes):
        experiment = load_experiment(experiment_path, list(args.set))
        model = describe_model(experiment.model_source())
        out = args.output / f"fit-{budget:.3f}"
        fit_started = time.time()
        run_fit(
            experiment,
            out,
            model,
            FitSettings(budget_gib=budget, granularity=granularity, max_micro_batch=max(sizes)),
            command="fit_bench fit",
        )
        fit_s = time.time() - fit_started
        for _, found in pd.read_csv(out / "fit.csv").iterrows():
            key = tuple(found[k] for k in POINT)
            column = peaks[key] if key in peaks.columns else pd.Series(dtype=float)
            answer = max((s for s in column.index if column[s] <= budget), default=None)
            rows.append(
                {
                    **{k: found[k] for k in POINT},
                    "budget_gib": round(budget, 3),
                    "exhaustive_max": answer,
                    "fit_max": found["max_micro_batch"],
                    "same": answer == found["max_micro_batch"],
                    "first_guess": found["predicted_max"],
                    "probes": found["probes"],
                    "search_s": round(found["search_s"], 1),
                    "fit_wall_s": round(fit_s, 1),
                    "exhaustive_trials": len(sizes),
                    "exhaustive_wall_s": round(exhaustive_s, 1),
                }
            )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--old", type=Path, help="a checkout of the older code: time its fit against --new's")
    parser.add_argument(
        "--new", type=Path, default=ROOT, help="the checkout whose fit is new (default: this one)"
    )
    parser.add_argument(
        "--budgets",
        default="1.669,2.035,2.48",
        help="with --old: GiB per rank, one fit each ('default': fit's own, on GPU)",
    )
    parser.add_argument(
        "--granularity", type=int, default=32, help="with --old: fit's --granularity (0: its default)"
    )
    parser.add_argument("--pairs", type=int, default=3, help="with --old: runs of each code per budget")
    parser.add_argument(
        "--sizes", default="32,64,96,128", help="without --old: the exhaustive sweep's micro-batches"
    )
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    args.output = args.output.resolve()
    args.output.mkdir(parents=True, exist_ok=True)
    experiment = Path(args.experiment).resolve()
    table = old_against_new(args, experiment) if args.old else against_exhaustive(args, experiment)
    folders = sorted(p for p in args.output.iterdir() if (p / "experiment.yaml").is_file())
    provenance = read_experiment_file(folders[0]).get("provenance", {}) if folders else {}
    text = "\n".join(f"- {k}: {v}" for k, v in provenance.items() if k in PROVENANCE) + "\n"
    text += f"- command: python bench/fit_bench.py {' '.join(sys.argv[1:])}\n\n"
    text += markdown_table(table, list(table.columns)) + "\n"
    table.to_csv(args.output / "fit_bench.csv", index=False)
    (args.output / "fit_bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
