"""`python -m ray_zero fit` against DeepSpeed's autotuner, on one machine, for the same model and stages.

    python bench/autotune_bench.py experiments/gpt2_fit_gpu.yaml --output OUT --time-limit 520     # one H200
    python bench/autotune_bench.py experiments/fit_gpt2_cpu.yaml --set seq_len=128 --budget-gib 1.5 \\
        --max-micro-batch 16 --output OUT                                                           # CPU
        smoke run

Each tool starts cold (a fresh process; the shared imports are loaded once first, untimed, so neither
pays for filling the page cache) and is timed to its answer:
- fit: `python -m ray_zero fit EXPERIMENT --set grid.stage=STAGES --set grid.num_workers=[1]` into OUT/fit;
- the autotuner: `deepspeed --autotuning tune bench/autotune_train.py --deepspeed_config ...` in
  OUT/autotuner, with ray_zero's DeepSpeed config for the experiment (micro-batch left out), fast mode,
  metric throughput, zero_optimization.stage = STAGES (the autotuner tunes the listed stages only), and
  bench/shims on PATH (its clean-up calls pdsh). `tune` rather than `run`: `run` only adds a training run
  with the answer after the answer is written;
- then the autotuner's recommended (stage, micro-batch, accumulation) is timed as a one-point
  `python -m ray_zero sweep` (OUT/sweep-autotuner), so both answers are timed by ray_zero's worker (fit
  times its own answer that way).
The parts run in that order, each surviving the others' failure; with --time-limit each is stopped
(SIGINT, then SIGKILL to its process group) where it would leave too little for the parts after it, and
the autotuner's partial results are read from its folders. Writes OUT/autotune_bench.md and .csv and
prints the table; the table reads whatever parts OUT holds, so `--only` runs can fill one OUT in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_zero.config import ConfigError, is_calibration  # noqa: E402
from ray_zero.experiment_file import load_experiment  # noqa: E402
from ray_zero.report.frame import markdown_table  # noqa: E402
from ray_zero.train.ds_config import build_ds_config  # noqa: E402

RUN_FILE = "bench_run.json"
SWEEP_RESERVE_S = 60
"""Seconds kept for the one-point sweep of the autotuner's answer (Ray's start, one trial; about 40 s on an
H200)."""
AUTOTUNER_RESERVE_S = 150
"""Seconds kept for the autotuner while fit runs, under --time-limit (fit is the part whose length is
known)."""
STOP_GRACE_S = 25
"""A stopped part's SIGINT grace (20 s) and SIGKILL wait (5 s): taken off its time so the bench ends in its
limit."""
WARM_IMPORTS = "import torch, deepspeed, transformers, ray.tune, ray.train.torch"


def autotuner_ds_config(
    experiment, stages: list[int], precision: str, folder: Path, max_micro: int | None
) -> dict:
    """ray_zero's DeepSpeed config for the experiment, as its DeepSpeedEngine builds it, less the batch
    sizes (the autotuner's to choose), plus the autotuning section."""
    e = experiment
    config = build_ds_config(
        stage=0,
        micro_batch_size=1,
        gradient_accumulation_steps=e.gradient_accumulation_steps,
        world_size=1,
        precision=precision,
        optimizer_type=e.optimizer.type,
        lr=e.optimizer.lr,
        betas=tuple(e.optimizer.betas),
        eps=e.optimizer.eps,
        weight_decay=e.optimizer.weight_decay,
        reduce_bucket_size=e.reduce_bucket_size,
        allgather_bucket_size=e.allgather_bucket_size,
    )
    config["gradient_clipping"] = (
        0.0  # ray_zero/train/deepspeed_engine.py DeepSpeedEngine: no clipping, as the torch engines
    )
    # train_batch_size would contradict the autotuner's micro-batches; accumulation stays the experiment's.
    del config["train_batch_size"], config["train_micro_batch_size_per_gpu"]
    # Autotuner.tune reads a list here as the stages to tune. In fast mode each experiment's zero section is
    # {"stage": N} alone, so DeepSpeed's default buckets apply there (ray_zero's time the answer).
    config["zero_optimization"]["stage"] = stages
    config["autotuning"] = {
        "enabled": True,
        "fast": True,
        "metric": "throughput",
        "results_dir": str(folder / "autotuning_results"),
        "exps_dir": str(folder / "autotuning_exps"),
    }
    if max_micro:
        config["autotuning"]["max_train_micro_batch_size_per_gpu"] = max_micro
    return config


def run_part(folder: Path, command: list[str], env: dict, timeout: float | None, cwd: Path = ROOT) -> dict:
    """Run one part from a cold start in its own process group; its output in folder.with_suffix('.log')."""
    folder.mkdir(parents=True, exist_ok=True)
    print(
        f"autotune_bench: {shlex.join(command)}" + (f"  (at most {timeout:.0f} s)" if timeout else ""),
        flush=True,
    )
    started = time.time()
    with open(folder.with_suffix(".log"), "w") as log:
        try:
            process = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as error:  # e.g. no `deepspeed` on PATH: this part's row says so, the others run
            log.write(f"could not start: {error}\n")
            run = {"command": shlex.join(command), "wall_s": None, "rc": "not started", "timed_out": False}
            (folder / RUN_FILE).write_text(json.dumps(run, indent=2))
            return run
        try:
            process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        # SIGINT first: ray_zero then shuts its Ray down, DeepSpeed's launcher kills its ranks; then whatever
        # of the group is left (also after a normal exit: nothing may keep GPU memory for the next part).
        for sig, grace in ((signal.SIGINT, 20), (signal.SIGKILL, 5)):
            if sig == signal.SIGINT and not timed_out:
                continue
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
    run = {
        "command": shlex.join(command),
        "wall_s": round(time.time() - started, 1),
        "rc": process.returncode,
        "timed_out": timed_out,
    }
    (folder / RUN_FILE).write_text(json.dumps(run, indent=2))
    print(
        f"autotune_bench: rc {run['rc']} after {run['wall_s']} s{' (time limit)' if timed_out else ''}",
        flush=True,
    )
    return run


def _run_info(folder: Path) -> dict:
    path = folder / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _failure(folder: Path, run: dict) -> str:
    """One line saying how a part ended badly ('' when it did not)."""
    if run.get("timed_out"):
        return f"stopped at the time limit after {run['wall_s']} s"
    if run.get("rc") in (0, None):
        return ""
    lines = [
        line.strip()
        for line in folder.with_suffix(".log").read_text(errors="replace").splitlines()
        if line.strip()
    ]
    errors = [line for line in lines if "error" in line.lower()]
    return f"rc {run['rc']}: {(errors or lines or ['no output'])[-1][:200]}"


def _stages_text(best: dict[int, int | None]) -> str:
    return ", ".join(
        f"{stage}: {value if value is not None else '-'}" for stage, value in sorted(best.items())
    )


def read_autotuner(folder: Path, stages: list[int]) -> dict:
    """Experiments, largest micro-batch that ran per stage, the answer and its throughput, from the
    autotuner's own files (results_dir/<experiment>/{exp.json,metrics.json,stderr.log}, summary.txt,
    ds_config_optimal.json); a stopped autotuner's best finished experiment stands in for its answer."""
    from deepspeed.autotuning.utils import search_error  # what the autotuner itself takes as a failure

    results = folder / "autotuning_results"
    run = _run_info(folder)
    row = {
        "tool": "DeepSpeed autotuner (fast, throughput)",
        "wall_s": run.get("wall_s"),
        "command": run.get("command"),
    }
    experiments, notes = [], []
    for exp_file in sorted(results.glob("*/exp.json"), key=lambda p: p.stat().st_mtime):
        exp = json.loads(exp_file.read_text())
        config, result_dir = exp["ds_config"], exp_file.parent
        metrics = result_dir / "metrics.json"
        experiments.append(
            {
                "name": exp["name"],
                "stage": config.get("zero_optimization", {}).get("stage"),
                "micro": config.get("train_micro_batch_size_per_gpu"),
                "gas": config.get("gradient_accumulation_steps", 1),
                "error": search_error(str(result_dir / "stderr.log")),
                "oom": "out of memory" in (result_dir / "stderr.log").read_text(errors="replace").lower()
                if (result_dir / "stderr.log").is_file()
                else False,
                "throughput": json.loads(metrics.read_text())["throughput"] if metrics.is_file() else None,
            }
        )
    tuned = [e for e in experiments if e["name"] != "profile_model_info"]
    ran = [e for e in tuned if e["throughput"] is not None and not e["error"]]
    row["experiments"] = len(experiments)
    row["max_micro_batch"] = _stages_text(
        {s: max((e["micro"] for e in ran if e["stage"] == s), default=None) for s in stages}
    )
    failed = [e for e in tuned if e not in ran]
    other = [e for e in failed if not e["oom"]]
    if experiments:
        notes.append(
            f"incl. the model-info profile run; {len(failed)} of {len(tuned)} tuning runs gave no metric, "
            f"{len(failed) - len(other)} of them out of memory"
            + (
                f" (other: {other[0]['name']}: {(other[0]['error'] or 'no metrics.json')[:120].strip()})"
                if other
                else ""
            )
        )
    optimal = results / "ds_config_optimal.json"
    if optimal.is_file():
        config = json.loads(optimal.read_text())
        answer = (
            config["zero_optimization"]["stage"],
            config["train_micro_batch_size_per_gpu"],
            config.get("gradient_accumulation_steps", 1),
        )
        measured = [e["throughput"] for e in ran if (e["stage"], e["micro"], e["gas"]) == answer]
        row["answer_from"] = "ds_config_optimal.json"
    elif ran:
        best = max(ran, key=lambda e: e["throughput"])
        answer, measured = (best["stage"], best["micro"], best["gas"]), [best["throughput"]]
        row["answer_from"] = "best finished experiment (no ds_config_optimal.json)"
        notes.append("no answer written: its best finished experiment stands in")
    else:
        answer, measured = None, []
    if answer:
        row["stage"], row["micro_batch_size"], row["gradient_accumulation_steps"] = answer
        row["recommended"] = f"stage {answer[0]}, micro-batch {answer[1]}" + (
            f" x {answer[2]} accumulated" if answer[2] != 1 else ""
        )
        row["reported"] = f"{max(measured):.1f} samples/s (DeepSpeed's timers)" if measured else None
    summary = results / "summary.txt"
    if summary.is_file():
        notes.append(
            summary.read_text().strip().splitlines()[-1].strip()
        )  # "Tuning completed in ... experiments: N."
    failure = _failure(folder, run) if run else "not run"
    row["note"] = "; ".join(([failure] if failure else []) + notes)
    return row


def read_fit(folder: Path) -> dict:
    """fit.csv (largest micro-batch per stage, probes, samples/s), best_config.json, results.csv (every
    trial)."""
    run = _run_info(folder)
    row = {"tool": "ray_zero fit", "wall_s": run.get("wall_s"), "command": run.get("command")}
    failure = _failure(folder, run) if run else "not run"
    if (folder / "fit.csv").is_file():
        fit = pd.read_csv(folder / "fit.csv")
        row["experiments"] = len(pd.read_csv(folder / "results.csv"))
        row["max_micro_batch"] = _stages_text(
            {
                int(r.stage): None if pd.isna(r.max_micro_batch) else int(r.max_micro_batch)
                for r in fit.itertuples()
            }
        )
        failure = "; ".join(
            filter(
                None,
                [
                    failure,
                    f"{int(fit['probes'].sum())} probes; "
                    f"{row['experiments'] - int(fit['probes'].sum())} calibration and timing trials",
                ],
            )
        )
    if (folder / "best_config.json").is_file():
        best = json.loads((folder / "best_config.json").read_text())
        row.update(
            stage=best["stage"],
            micro_batch_size=best["micro_batch_size"],
            gradient_accumulation_steps=None,
            recommended=f"stage {best['stage']}, micro-batch {best['micro_batch_size']}",
            reported=f"{best['samples_per_s']:.1f} samples/s (its timed trial)",
            samples_per_s=round(best["samples_per_s"], 1),
            answer_from="best_config.json",
        )
    row["note"] = failure
    return row


def read_sweep(folder: Path) -> tuple[float | None, str]:
    run = _run_info(folder)
    if not (folder / "results.csv").is_file():
        return None, ("timing sweep: " + (_failure(folder, run) or "no results.csv")) if run else ""
    results = pd.read_csv(folder / "results.csv")
    results = results[~results["trial"].map(is_calibration)] if "trial" in results else results
    if results.empty:  # stopped before its trial finished
        return None, "timing sweep: " + (_failure(folder, run) or "no trial finished")
    result = results.iloc[0]
    if result["status"] != "ok":
        return None, f"timing sweep: {result['status']}: {str(result.get('error', ''))[:160]}"
    return round(float(result["samples_per_s"]), 1), ""


def provenance(command: str) -> str:
    versions = ", ".join(f"{name} {_version(name)}" for name in ("torch", "deepspeed", "ray", "transformers"))
    gpu = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        .stdout.strip()
        .replace("\n", ", ")
        if shutil.which("nvidia-smi")
        else ""
    )
    return (
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}\n- machine: {platform.node()}, {os.cpu_count()} CPUs"
        f"{', ' + gpu if gpu else ', no GPU'}\n- python {platform.python_version()}, {versions}\n"
        f"- command: python bench/autotune_bench.py {command}\n"
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def write_table(out: Path, stages: list[int], command: str) -> pd.DataFrame:
    def guarded(tool: str, read) -> dict:  # a half-written folder costs its own row's figures, not the table
        try:
            return read()
        except Exception as error:
            return {
                "tool": tool,
                "note": f"reading its results failed: {type(error).__name__}: {error}"[:240],
            }

    def autotuner_row() -> dict:
        row = read_autotuner(out / "autotuner", stages)
        row["samples_per_s"], problem = read_sweep(out / "sweep-autotuner")
        row["note"] = "; ".join(filter(None, [row["note"], problem]))
        return row

    rows = []
    if (out / "fit").is_dir():
        rows.append(guarded("ray_zero fit", lambda: read_fit(out / "fit")))
    if (out / "autotuner").is_dir():
        rows.append(guarded("DeepSpeed autotuner (fast, throughput)", autotuner_row))
    columns = [
        "tool",
        "wall_s",
        "experiments",
        "max_micro_batch",
        "recommended",
        "reported",
        "samples_per_s",
        "note",
    ]
    table = pd.DataFrame(rows).reindex(columns=columns + ["answer_from", "command"])
    table.to_csv(out / "autotune_bench.csv", index=False)
    text = (
        f"# fit against DeepSpeed's autotuner: stages {stages}, 1 worker\n\n{provenance(command)}\n"
        "wall_s: the tool's process, start to exit (its answer written); experiments: trials or launches "
        "run; "
        "max_micro_batch: per stage, the largest micro-batch that ran (fit: fitted its budget); "
        "samples_per_s: the answer timed by ray_zero's worker (fit's timed trial; a one-point sweep for the "
        "autotuner's).\n\n"
        + markdown_table(table[columns], columns)
        + "\n\nCommands:\n\n"
        + "".join(
            f"- {r['tool']}: `{r['command']}`\n" for _, r in table.iterrows() if isinstance(r["command"], str)
        )
    )
    sweep = _run_info(out / "sweep-autotuner")
    if sweep:
        text += f"- timing the autotuner's answer: `{sweep['command']}`\n"
    (out / "autotune_bench.md").write_text(text)
    print(text, flush=True)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", type=Path)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override an experiment key"
    )
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--stages", help="comma-separated ZeRO stages (default: the experiment's grid.stage)")
    parser.add_argument("--only", choices=["autotuner", "fit", "both"], default="both")
    parser.add_argument("--budget-gib", type=float, help="fit's --budget-gib (required on CPU)")
    parser.add_argument(
        "--max-micro-batch",
        type=int,
        help="largest micro-batch either tool tries (fit's --max-micro-batch, the autotuner's "
        "max_train_micro_batch_size_per_gpu, 1024 unless given)",
    )
    parser.add_argument("--time-limit", type=float, help="seconds for the whole bench, warm-up included")
    args = parser.parse_args()
    started = time.time()
    command = shlex.join(sys.argv[1:])
    try:
        experiment = load_experiment(args.experiment, args.set)
        stages = (
            [int(s) for s in args.stages.split(",")] if args.stages else sorted(set(experiment.grid.stage))
        )
        if experiment.resolved_dataset() != "synthetic" or experiment.steps is None:
            raise ConfigError(
                "the autotuner's script trains on ray_zero's synthetic batches for `steps`: "
                "give a model that is not a preset, and steps"
            )
        if experiment.device == "cpu" and args.budget_gib is None and args.only != "autotuner":
            raise ConfigError("fit on CPU needs --budget-gib G (the peak resident set per worker)")
    except (ConfigError, ValueError) as error:
        print(f"autotune_bench: error: {error}", file=sys.stderr)
        return 2
    out = args.output.resolve()
    parts = {
        "fit": ["fit"],
        "autotuner": ["autotuner", "sweep-autotuner"],
        "both": ["fit", "autotuner", "sweep-autotuner"],
    }[args.only]
    taken = [part for part in parts if (out / part).exists()]
    if taken:
        print(
            f"autotune_bench: error: {out / taken[0]} exists: give a new --output (or --only the other tool)",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)

    use_gpu = experiment.device == "gpu" or (
        experiment.device == "auto" and shutil.which("nvidia-smi") is not None
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PATH=os.pathsep.join(
            [str(ROOT / "bench" / "shims"), str(Path(sys.executable).parent), os.environ["PATH"]]
        ),
        PYTHONUNBUFFERED="1",
    )
    if not use_gpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed's launcher and engine on CPU (gloo), as ray_zero's workers
    sets = [item for kv in args.set for item in ("--set", kv)]
    point = [
        "--set",
        f"grid.stage={stages}",
        "--set",
        "grid.num_workers=[1]",
        "--set",
        "grid.backend=[deepspeed]",
    ]

    def left(reserve: float = 0) -> float | None:
        return (
            None
            if args.time_limit is None
            else max(args.time_limit - (time.time() - started) - reserve - STOP_GRACE_S, 1)
        )

    # Both tools import the same packages: load them once, untimed, so the first tool does not pay alone for
    # reading them from disk (and, on the GPU image, for compiling their bytecode into PYTHONPYCACHEPREFIX).
    subprocess.run([sys.executable, "-c", WARM_IMPORTS], env=env, cwd=ROOT, capture_output=True)
    print(f"autotune_bench: imports warmed in {time.time() - started:.0f} s", flush=True)

    if "fit" in parts:
        budget = ["--budget-gib", str(args.budget_gib)] if args.budget_gib else []
        largest = ["--max-micro-batch", str(args.max_micro_batch)] if args.max_micro_batch else []
        later = AUTOTUNER_RESERVE_S + SWEEP_RESERVE_S if "autotuner" in parts else 0
        run_part(
            out / "fit",
            [
                sys.executable,
                "-m",
                "ray_zero",
                "fit",
                str(args.experiment.resolve()),
                *sets,
                *point,
                "--output",
                str(out / "fit"),
                *budget,
                *largest,
            ],
            env,
            left(later),
        )
    if "autotuner" in parts:
        folder = out / "autotuner"
        folder.mkdir()
        precision = experiment.resolved_precision(use_gpu)
        config_path = folder / "ds_config.json"
        config_path.write_text(
            json.dumps(
                autotuner_ds_config(experiment, stages, precision, folder, args.max_micro_batch), indent=2
            )
        )
        deepspeed = shutil.which("deepspeed", path=env["PATH"]) or "deepspeed"
        # --hostfile names no file: with one, the launcher checks passwordless ssh to every host.
        run_part(
            folder,
            [
                deepspeed,
                "--autotuning",
                "tune",
                "--num_gpus",
                "1",
                "--hostfile",
                str(folder / "no-hostfile"),
                str(ROOT / "bench" / "autotune_train.py"),
                "--deepspeed_config",
                str(config_path),
                str(args.experiment.resolve()),
                *sets,
            ],
            env,
            left(SWEEP_RESERVE_S),
            cwd=folder,
        )
        try:
            answer = read_autotuner(folder, stages)
        except Exception as error:  # a half-written folder must not cost the table
            answer = {}
            print(f"autotune_bench: reading the autotuner's results failed: {error}", flush=True)
        if answer.get("stage") is not None:
            run_part(
                out / "sweep-autotuner",
                [
                    sys.executable,
                    "-m",
                    "ray_zero",
                    "sweep",
                    str(args.experiment.resolve()),
                    *sets,
                    *point,
                    "--set",
                    f"grid.stage=[{answer['stage']}]",
                    "--set",
                    f"grid.micro_batch_size=[{answer['micro_batch_size']}]",
                    "--set",
                    f"gradient_accumulation_steps={answer['gradient_accumulation_steps']}",
                    "--set",
                    "calibrate=false",  # the memory model's calibration is no part of timing one point
                    "--output",
                    str(out / "sweep-autotuner"),
                ],
                env,
                left(),
            )
    write_table(out, stages, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
