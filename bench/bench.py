"""ray_zero against bare DeepSpeed: the same configurations, one machine, one invocation.

    python bench/bench.py experiments/quick.yaml --output /tmp/bench              # both ways, per worker
    count
    python bench/bench.py experiments/quick.yaml --packing --output /tmp/bench    # then eight 1-worker trials
    python bench/bench.py EXPERIMENT --set KEY=VALUE ... --throughput 5 --output /tmp/tp     # samples/s,
    repeated
    python bench/bench.py ... --set 'grid.num_workers=[1]' --throughput 5 --side-by-side --output /tmp/sbs  #
    2 GPUs

For each worker count: the points as bare DeepSpeed under torchrun (bench/bare_deepspeed.py: the same
ray_zero.train.worker.train, no Ray), one after the other; then as a ray_zero sweep on a private Ray with room
for exactly one trial of that size. bench.csv / bench.md, per trial: samples/s both ways and their ratio;
the per-trial overhead, what the trial adds to the run beyond its timed steps (bare: torchrun's wall time;
ray_zero: the previous trial's row to its own, a sweep's first trial from the sweep's call) minus timed_s;
where that time went (wall-clock marks, slowest rank). The earlier bench.csv's column names are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from common import ROOT

sys.path.insert(0, str(ROOT))

from bare_and_ray import (  # noqa: E402
    BARE_PHASES,
    RAY_PHASES,
    bare_spec,
    only,
    pair,
    plan_and_model,
    ray_rows,
    run_bare,
    sweep_alone,
)

from ray_zero.experiment_file import load_experiment  # noqa: E402
from ray_zero.report.frame import markdown_table  # noqa: E402
from ray_zero.run.plan import local_cluster  # noqa: E402
from ray_zero.run.sweep import run_sweep  # noqa: E402
from ray_zero.store import atomic_write, load_trials, read_provenance  # noqa: E402


def compare(experiment, output: Path) -> pd.DataFrame:
    (plan, model), workdir, records = plan_and_model(experiment), Path(tempfile.mkdtemp(prefix="bare-")), []
    for workers in sorted({p.num_workers for p in plan.runnable}):
        points = [p for p in plan.runnable if p.num_workers == workers]
        print(f"bench: bare DeepSpeed {', '.join(p.name for p in points)}, one after the other", flush=True)
        bare = {p.name: run_bare(bare_spec(experiment, p, plan, model, workdir), workdir) for p in points}
        print(
            f"bench: ray_zero sweep of the same {len(points)} points, on a Ray with room for one "
            f"{workers}-worker trial",
            flush=True,
        )
        folder = output / "ray_zero" / f"w{workers}"
        called_at = sweep_alone(
            only(experiment, num_workers=workers), folder, workers, plan.use_gpu, "bench/bench.py"
        )
        for order, row in enumerate(ray_rows(folder, called_at), 1):
            b = bare[row["trial"]]
            phases_s = {k: v for k, v in {**b, **row}.items() if k.startswith(("bare ", "ray "))}
            records.append({"trial": row["trial"], "order_in_sweep": order, **pair(b, row), **phases_s})
    return pd.DataFrame(records)


def side_by_side_pair(spec, single, folder: Path, workdir: Path, bare_gpu: str, delay_s: float):
    """Bare on GPU `bare_gpu`, ray_zero on the other, at once; bare `delay_s` later. Returns (bare,
    called_at)."""

    def bare_later() -> dict:
        time.sleep(delay_s)
        return run_bare(spec, workdir, env={"CUDA_VISIBLE_DEVICES": bare_gpu})

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(1 - int(bare_gpu))  # what the private Ray (raylet, workers) sees
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(bare_later)
            called_at = sweep_alone(single, folder, 1, True, "bench/bench.py --throughput --side-by-side")
            return pending.result(), called_at
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES")
        if saved is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def throughput(
    experiment, output: Path, repeats: int, side_by_side: bool, bare_delay_s: float
) -> pd.DataFrame:
    """Samples/s: each point `repeats` times, bare and ray_zero in turn, the first of each pair swapped every
    repeat, so that a drift of the machine hits both alike. With `side_by_side` both at once, a GPU each
    (swapped every repeat), bare started later so that the timed steps coincide. Each ray_zero run is a
    sweep's first trial on a fresh Ray: each pair also gives a first-trial overhead."""
    (plan, model), workdir, records = plan_and_model(experiment), Path(tempfile.mkdtemp(prefix="bare-")), []
    for point in plan.runnable:
        spec, single = bare_spec(experiment, point, plan, model, workdir), only(experiment, **asdict(point))
        for repeat in range(1, repeats + 1):
            folder, bare_gpu = output / "throughput" / f"{point.name}-{repeat}", str(repeat % 2)
            first = "at once" if side_by_side else ("bare" if repeat % 2 else "ray_zero")
            print(f"bench: throughput {point.name}, repeat {repeat}, first: {first}", flush=True)
            if side_by_side:
                bare, called_at = side_by_side_pair(spec, single, folder, workdir, bare_gpu, bare_delay_s)
            else:
                bare = run_bare(spec, workdir) if first == "bare" else None
                called_at = sweep_alone(
                    single, folder, point.num_workers, plan.use_gpu, "bench/bench.py --throughput"
                )
                bare = bare or run_bare(spec, workdir)
            ray_side = ray_rows(folder, called_at)[0]
            record = {
                "trial": point.name,
                "repeat": repeat,
                "first": first,  # a sweep's first trial, each
                **{
                    k.replace("ray_zero_overhead", "ray_zero_first_trial_overhead"): v
                    for k, v in pair(bare, ray_side).items()
                },
            }
            if side_by_side:  # the share of the timed steps that ran together; the next bare start, shifted
                (b0, b1), (r0, r1) = [
                    (m["warmed_up_at"], m["finished_at"]) for m in (bare["marks"], ray_side["marks"])
                ]
                record["timed_overlap"] = max(0.0, min(b1, r1) - max(b0, r0)) / max(b1 - b0, r1 - r0)
                bare_delay_s = max(0.0, bare_delay_s + r0 - b0)
            records.append(record)
            pd.DataFrame(records).to_csv(output / "throughput.csv", index=False)  # kept if cut short
    return pd.DataFrame(records)


def throughput_summary(table: pd.DataFrame) -> pd.DataFrame:
    ratios = table.groupby("trial", sort=False)["samples_per_s_ratio"]
    return pd.DataFrame(
        {
            "pairs": ratios.size(),
            "median_ratio": ratios.median(),
            "geometric_mean_ratio": ratios.apply(statistics.geometric_mean),
            "min_ratio": ratios.min(),
            "max_ratio": ratios.max(),
        }
    ).reset_index()


def packing(experiment, output: Path) -> dict:
    """Eight 1-worker trials on the whole machine (run_sweep's own private Ray): the span from the first
    fit() to the last over the sum of the trials' fit() times (1 / trials at once, at best)."""
    # No early starts: a trial's fit() time is then its own, not a wait for a free GPU.
    eight = only(
        experiment.model_copy(
            update={"runtime": experiment.runtime.model_copy(update={"overlap_startup": False})}
        ),
        stage=[0, 1],
        micro_batch_size=[16, 32, 48, 64],
        num_workers=1,
    )
    run_sweep(eight, output / "packing", command="bench/bench.py --packing", diagnostics=True)
    rows = [r for r in load_trials(output / "packing") if r["status"] == "ok"]
    span = max(r["diagnostics"][0]["fit_finished_at"] for r in rows) - min(
        r["diagnostics"][0]["fit_started_at"] for r in rows
    )
    summed = sum(r["wall_s"] for r in rows)
    return {
        "trials": len(rows),
        "sum_of_trial_walls_s": summed,
        "first_start_to_last_finish_s": span,
        "ratio": span / summed,
        "max_concurrent_trials": read_provenance(output / "packing")["max_concurrent_trials"],
    }


def provenance(folder: Path) -> dict:
    """A sweep's machine, versions and date, with this benchmark's command; not its cluster lines (a Ray
    sized for one trial, not the machine)."""
    prov = {
        k: v
        for k, v in (read_provenance(folder) or {}).items()
        if k not in ("experiment", "question", "cluster", "max_concurrent_trials")
    }
    return {
        **prov,
        "command": shlex.join(["python", "bench/bench.py", *sys.argv[1:]]),
        "bare": "torchrun --standalone, OMP_NUM_THREADS as Ray sets it (runtime.cpus_per_worker)",
        "ray_zero": "a private Ray with room for exactly one trial (per worker count; per run with --throughput)",  # noqa: E501
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", nargs="?", default=str(ROOT / "experiments" / "quick.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="as for ray_zero sweep")
    parser.add_argument("--packing", action="store_true", help="then time a grid of eight 1-worker trials")
    parser.add_argument("--only-packing", action="store_true", help="time the eight 1-worker trials only")
    parser.add_argument(
        "--throughput",
        type=int,
        metavar="R",
        default=0,
        help="instead: samples/s only, each point R times, bare and ray_zero alternating",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="with --throughput, 1-worker points, 2 GPUs: bare and ray_zero at once, a GPU each",
    )
    parser.add_argument(
        "--bare-delay",
        type=float,
        default=15.0,
        metavar="S",
        help="with --side-by-side: start the first bare run S s after the sweep (default 15)",
    )
    parser.add_argument(
        "--output", type=Path, required=True, help="a new folder: bench.md, bench.csv, the sweeps"
    )
    args = parser.parse_args()
    if args.output.is_dir() and any(args.output.iterdir()):
        parser.error(f"--output {args.output} is not empty: give a new folder")  # the sweeps would refuse it
    experiment = load_experiment(args.experiment, args.overrides).with_absolute_paths()
    if args.side_by_side:
        cluster = local_cluster()
        if not args.throughput or experiment.grid.num_workers != [1] or cluster.gpus < 2:
            parser.error(
                "--side-by-side needs --throughput R, --set 'grid.num_workers=[1]' and 2 GPUs "
                f"(this machine has {cluster.gpus})"
            )
    args.output.mkdir(parents=True, exist_ok=True)
    title, sections = f"# ray_zero vs bare DeepSpeed: {experiment.name}", []
    if args.throughput:
        table = throughput(experiment, args.output, args.throughput, args.side_by_side, args.bare_delay)
        prov = provenance(next((args.output / "throughput").iterdir()))
        sections = [
            "## Samples/s, bare and ray_zero in turn" + (" (side by side)" if args.side_by_side else ""),
            markdown_table(table, list(table.columns)),
            "## Per point",
            markdown_table(summary := throughput_summary(table), list(summary.columns)),
        ]
        name = "throughput"
    else:
        prov, name = {}, "bench"
        if not args.only_packing:
            table = compare(experiment, args.output)
            table.to_csv(args.output / "bench.csv", index=False)
            prov = provenance(next((args.output / "ray_zero").iterdir()))
            chain = [f"bare {p}" for p, _, _ in BARE_PHASES] + [f"ray {p}" for p, _, _ in RAY_PHASES]
            where = table.set_index("trial")[[c for c in chain if c in table.columns]].T
            where = where.reset_index().rename(columns={"index": "phase"})
            figures = [c for c in table.columns if not c.startswith(("bare ", "ray "))]
            sections = [
                "## Samples/s and per-trial overhead (s)",
                markdown_table(table, figures),
                "## Where each trial's time went (s, slowest rank; a column adds up to its wall_s)",
                markdown_table(where, list(where.columns)),
            ]
        if args.packing or args.only_packing:
            packed = packing(experiment, args.output)
            prov = prov or provenance(args.output / "packing")
            (args.output / "packing.json").write_text(json.dumps(packed, indent=1))
            sections += [
                "## Packing: eight 1-worker trials",
                "\n".join(
                    f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in packed.items()
                ),
            ]
    atomic_write(args.output / "provenance.json", json.dumps(prov, indent=1, default=str))
    text = "\n\n".join([title, "\n".join(f"- {k}: {v}" for k, v in prov.items()), *sections]) + "\n"
    atomic_write(args.output / f"{name}.md", text)
    print(text)


if __name__ == "__main__":
    main()
