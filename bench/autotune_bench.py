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
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT

sys.path.insert(0, str(ROOT))

from autotune_table import RUN_FILE, read_autotuner, write_table  # noqa: E402

from ray_zero.config import ConfigError  # noqa: E402
from ray_zero.experiment_file import load_experiment  # noqa: E402
from ray_zero.train.ds_config import build_ds_config  # noqa: E402

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
