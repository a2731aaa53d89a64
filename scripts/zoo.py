"""The conformance zoo on one device: each family's experiment (experiments/zoo_*.yaml) in each precision,
every engine of its grid, every engine calibrated at three sizes; per family and precision a results
folder as a sweep writes it (trials.jsonl, calibration.json, results.csv/md, per_rank.csv, report.html).

Why not `python -m ray_zero sweep`: a Ray Train run costs 12-14 s over bare DeepSpeed per trial on the
H200 (bench/bench.md), and the zoo is some 180 short runs; a device lease is 30 minutes. So each family
and precision runs in one fresh process holding one rank (torch.distributed, nccl on GPU, gloo on CPU),
which trains every point and calibration probe in turn with the rank code of a sweep
(`ray_zero.train.worker.train`), on a copy of the model built once, and makes the rows with the sweep's code
(rows.py, calibration.py, report.py). Between runs the rank frees what the run held and checks that
allocated memory is back where it started (the console's `leftover`: a run that began above it
would measure a higher peak; Engine.close lets DeepSpeed go). The grid's points run first; calibration after.

    python scripts/zoo.py experiments/zoo_*.yaml --precision bf16 fp16 --output results/zoo-h200
    python scripts/zoo.py experiments/zoo_resnet50.yaml --precision bf16 --output /tmp/zoo --set device=auto \
        --set model=timm:resnet18 --set 'input_shape=[3,64,64]' --set 'grid.micro_batch_size=[4]'  # CPU,
        small
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1024**3


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "deepspeed", "transformers", "timm"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _provenance(experiment, precision: str, device, command: str) -> dict:
    import torch

    gpu = f"1 x {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "none"
    memory = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None
    return {
        "experiment": experiment.name,
        "question": experiment.question,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        **_versions(),
        "ray": "not used (scripts/zoo.py: one rank in one process)",
        "driver_gpus": gpu,
        "gpu_memory_gib": memory,
        "cpu": f"{platform.machine()} ({os.cpu_count()} logical CPUs)",
        "cluster": "one process, one rank",
        "device": "gpu" if device.type == "cuda" else "cpu",
        "precision": precision,
        "max_concurrent_trials": 1,
    }


def _release(device) -> int:
    """Free what the last run left to the garbage collector; the bytes still allocated."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _run(spec, device, pristine, baseline: int) -> tuple[dict, float]:
    """One run of `spec` on this rank: its results row, as a sweep's trial makes it, and the bytes left
    allocated by the runs before it (not a column of the row: the console says it)."""
    from ray_zero.models.spec import copied
    from ray_zero.rows import aggregate_ranks, failed_row_fields, trial_row
    from ray_zero.train.worker import train

    row = trial_row(spec)
    leftover = _release(device) - baseline
    started = time.time()
    try:
        result = train(spec, 0, 1, device, model=copied(pristine))
    except Exception as error:  # the row says what happened; the zoo goes on
        row.update(failed_row_fields({0: error}))
    else:
        row.update(status="ok", **aggregate_ranks([result]))
        row["per_rank"] = [{"trial": spec.name, **result}]
    row.update(attempts=1, wall_s=time.time() - started)
    return row, leftover


def run_family(path: str, precisions: list[str], output: Path, overrides: list[str], command: str) -> None:
    """One family in each precision, in this process (the child of `main`): a folder per precision."""
    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("ZOO_PORT", "29517"),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    if on_gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1)
    for precision in precisions:
        run_one(path, precision, output / f"{Path(path).stem}_{precision}", overrides, command)
    dist.destroy_process_group()


def run_one(path: str, precision: str, output: Path, overrides: list[str], command: str) -> None:
    """One family in one precision."""
    import torch
    import yaml

    from ray_zero.config import TrialSpec
    from ray_zero.experiment_file import load_experiment
    from ray_zero.measure import calibration
    from ray_zero.models.describe import build_model_spec, describe_model
    from ray_zero.report.tables import write_pages, write_results
    from ray_zero.rows import repredicted, skipped_row
    from ray_zero.run.plan import Cluster, plan_sweep
    from ray_zero.store import EXPERIMENT_FILE, append_trial, atomic_write
    from ray_zero.train.grid_trace import trace_grid, trace_key

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    experiment = load_experiment(path, [*overrides, f"precision={precision}"]).with_absolute_paths()
    model = describe_model(experiment.model_source())
    cluster = Cluster(gpus=1 if on_gpu else 0, cpus=os.cpu_count() or 1, source="this process")
    plan = plan_sweep(experiment, cluster)
    output.mkdir(parents=True, exist_ok=True)
    provenance = _provenance(experiment, plan.precision, device, command)
    atomic_write(
        output / EXPERIMENT_FILE,
        yaml.safe_dump(
            {
                "experiment": experiment.model_dump(mode="json"),
                "model": dataclasses.asdict(model),
                "provenance": provenance,
            },
            sort_keys=False,
        ),
    )

    # Each point's step traced before any run, as a sweep's session traces it (ray_zero/train/grid_trace.py).
    traced = trace_grid(experiment.model_source(), plan.runnable, plan.precision) if on_gpu else {}
    untraced = {(p.backend, p.activation_checkpointing) for p in plan.runnable}
    untraced = {
        k
        for k in untraced
        if isinstance(traced.get(trace_key(k[0], plan.precision, k[1])), (str, type(None)))
    }

    def spec(point, length=experiment, label=""):
        activations = traced.get(trace_key(point.backend, plan.precision, point.activation_checkpointing))
        return TrialSpec(
            length, point, plan.precision, on_gpu, model, str(output), label=label, activations=activations
        )

    torch.manual_seed(experiment.seed)
    pristine = build_model_spec(experiment.model_source())
    baseline = _release(device)
    probe = calibration.probe_experiment(experiment)
    # torch_zero last among the points and among the calibrations: on an H200, DDP left up to 4 bytes per
    # parameter allocated after its rank returned (not on CPU), which a later run would count as its own.
    last = lambda point: point.backend == "torch_zero"  # noqa: E731
    runs = [spec(p) for p in sorted(plan.runnable, key=last)] + [
        spec(p, probe, "calibration")
        for p in sorted(
            calibration.calibration_points(
                experiment,
                model,
                plan.precision,
                plan.use_gpu,
                calibration.engines_to_calibrate(experiment, plan.use_gpu, untraced),
            ),
            key=last,
        )
    ]
    rows = [skipped_row(spec(p), reason) for p, reason in plan.skipped]
    print(f"zoo: {experiment.name} {plan.precision}: {model.description}; {len(runs)} runs", flush=True)
    for run in runs:
        row, leftover = _run(run, device, pristine, baseline)
        rows.append(row)
        peak = row.get("peak_allocated_gib_max")
        print(
            f"zoo:   {row['trial']}: {row['status']} peak {peak if peak is None else round(peak, 3)} GiB, "
            f"leftover {leftover / GIB:.3f} GiB, {row['wall_s']:.1f} s"
            + (f"; {row['error']}" if row.get("error") else ""),
            flush=True,
        )
    measured = [r for r in rows if r["trial"].endswith("_calibration")]
    found = None
    if measured:  # the calibration ran after the grid here: its rows are predicted with it now, once
        found = calibration.write_calibration(output, experiment, measured, on_gpu, plan.precision)
        print(f"zoo:   {calibration.summary(found)}", flush=True)
    rows = [repredicted(row, found) for row in rows]
    for row in rows:
        append_trial(output, row)
    frame = write_results(output, rows, provenance)
    write_pages(output, frame)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiments", nargs="+", help="zoo experiment files")
    parser.add_argument("--precision", nargs="+", default=["bf16"], choices=["fp16", "bf16", "fp32"])
    parser.add_argument(
        "--output", type=Path, required=True, help="one folder per family and precision goes here"
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting families after this long")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child's own run
    args = parser.parse_args()
    command = " ".join(["python", "scripts/zoo.py", *sys.argv[1:]])
    if args.one:
        run_family(
            args.experiments[0],
            args.precision,
            args.output,
            args.overrides,
            os.environ.get("ZOO_COMMAND", command),
        )
        return 0
    started, failures = time.time(), 0
    for path in args.experiments:
        for precision in args.precision:  # a fresh process each: nothing one leaves reaches the other
            left = None if args.budget_s is None else args.budget_s - (time.time() - started)
            name = f"{Path(path).stem}_{precision}"
            if left is not None and left < 30:
                print(f"zoo: {name}: not run, {left:.0f} s of the budget left", flush=True)
                continue
            child = [
                sys.executable,
                __file__,
                path,
                "--precision",
                precision,
                "--output",
                str(args.output),
                "--one",
                *[f"--set={o}" for o in args.overrides],
            ]
            try:
                done = subprocess.run(child, timeout=left, env={**os.environ, "ZOO_COMMAND": command})
                failures += done.returncode != 0
            except subprocess.TimeoutExpired:
                print(f"zoo: {name}: stopped at the budget", flush=True)
                failures += 1
    print(f"zoo: done in {time.time() - started:.0f} s, {failures} families failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
