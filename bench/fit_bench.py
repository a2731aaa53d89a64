"""`fit` against the exhaustive sweep it replaces: same experiment, same granularity, one machine.

    python bench/fit_bench.py experiments/fit_gpt2_cpu.yaml --sizes 32,64,96,128 --output /tmp/fitbench

First every micro-batch of --sizes for every point of the grid (the exhaustive sweep), then, for each
pair of neighbouring sizes whose peaks leave a gap for every point, a `fit` whose budget lies midway in
that gap. Per (budget, point): the exhaustive answer, fit's answer, its first guess (the memory model's),
its probes and its search time, beside the exhaustive sweep's trials and wall time. Writes fit_bench.csv
and fit_bench.md in --output and prints the table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_zero.experiment_file import load_experiment  # noqa: E402
from ray_zero.fit import FitSettings, run_fit  # noqa: E402
from ray_zero.models import describe_model  # noqa: E402
from ray_zero.report import markdown_table  # noqa: E402
from ray_zero.sweep import run_sweep  # noqa: E402
from ray_zero.store import read_experiment_file  # noqa: E402

POINT = ["backend", "stage", "num_workers", "activation_checkpointing", "offload_optimizer"]


def midway_budgets(peaks: pd.DataFrame, sizes: list[int]) -> list[tuple[int, float]]:
    """(size below the budget, budget) for each neighbouring pair whose gap holds for every point."""
    budgets = []
    for low, high in zip(sizes, sizes[1:]):
        fits, over = peaks.loc[low], peaks.loc[high]
        if fits.max() < over.min():
            budgets.append((low, float(fits.max() + over.min()) / 2))
    return budgets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--sizes", default="32,64,96,128", help="the exhaustive sweep's micro-batches, evenly spaced")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    granularity = sizes[1] - sizes[0]
    if any(b - a != granularity for a, b in zip(sizes, sizes[1:])) or sizes[0] != granularity:
        sys.exit(f"fit_bench: --sizes {args.sizes}: give multiples of one step from the step itself, e.g. 32,64,96,128")

    started = time.time()
    exhaustive = run_sweep(load_experiment(Path(args.experiment), [*args.set, f"grid.micro_batch_size={sizes}"]),
                           args.output / "exhaustive", command="fit_bench exhaustive")
    exhaustive_s = time.time() - started
    ok = exhaustive[exhaustive["status"] == "ok"]
    peaks = ok.pivot_table(index="micro_batch_size", columns=POINT, values="peak_allocated_gib_max")
    rows = []
    for below, budget in midway_budgets(peaks, sizes):
        experiment = load_experiment(Path(args.experiment), list(args.set))
        model = describe_model(experiment.model, experiment.model_options, experiment.seq_len,
                               experiment.input_shape, experiment.num_classes)
        out = args.output / f"fit-{budget:.3f}"
        fit_started = time.time()
        run_fit(experiment, out, model, FitSettings(budget_gib=budget, granularity=granularity,
                                                    max_micro_batch=max(sizes)), command="fit_bench fit")
        fit_s = time.time() - fit_started
        for _, found in pd.read_csv(out / "fit.csv").iterrows():
            key = tuple(found[k] for k in POINT)
            column = peaks[key] if key in peaks.columns else pd.Series(dtype=float)
            answer = max((s for s in column.index if column[s] <= budget), default=None)
            rows.append({**{k: found[k] for k in POINT}, "budget_gib": round(budget, 3),
                         "exhaustive_max": answer, "fit_max": found["max_micro_batch"],
                         "same": answer == found["max_micro_batch"], "first_guess": found["predicted_max"],
                         "probes": found["probes"], "search_s": round(found["search_s"], 1),
                         "fit_wall_s": round(fit_s, 1), "exhaustive_trials": len(sizes),
                         "exhaustive_wall_s": round(exhaustive_s, 1)})
    table = pd.DataFrame(rows)
    provenance = read_experiment_file(args.output / "exhaustive").get("provenance", {})
    text = "\n".join(f"- {k}: {v}" for k, v in provenance.items() if k in ("date", "python", "torch", "deepspeed", "ray", "cpu", "cluster")) + "\n"
    text += f"- command: python bench/fit_bench.py {' '.join(sys.argv[1:])}\n\n"
    text += markdown_table(table, list(table.columns)) + "\n"
    args.output.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.output / "fit_bench.csv", index=False)
    (args.output / "fit_bench.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
