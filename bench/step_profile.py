"""Where a host-bound step's host time goes: ray_zero's own per-step Python, the engine's (DeepSpeed,
torch's DDP / FSDP2 / optimizer code), and the rest (torch's operators, C) (issue 53, part 2).

    python bench/step_profile.py --output OUT [--checkout OLD_CHECKOUT] [--device gpu] [--set KEY=VALUE ...]

One rank (world size 1) runs ray_zero.train.worker.train, the function a Ray Train worker runs, for each
engine in a fresh process (as each trial's worker is: DeepSpeed's ZeRO-3 leaves hooks in a process);
cProfile is on from the start of the timed window to its end only (Meter.start_timing /
stop_timing), so warm-up and set-up are left out. Each function's own time (cProfile's tottime, callees
left out) is put with the package its file belongs to. `--checkout` runs another checkout's ray_zero
(e.g. a worktree of the commit before) with this script. cProfile slows every Python call: the shares
say where the host's time goes, not the step's time without the profiler, which is printed beside.
Written: OUT/profile-LABEL.json (each engine: per step, seconds by package and ray_zero's functions).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ENGINES = [("deepspeed", 0), ("deepspeed", 3), ("torch_zero", 0), ("fsdp", 3)]
SEED = ["model=seed", "dataset=synthetic", "steps=230", "warmup_steps=30"]
"""The default: the seed model at micro-batch 1, a step the host sets the pace of."""


def package(filename: str, ours: str) -> str:
    if filename.startswith(ours + "models"):
        return "the model (ray_zero's preset and loss)"
    if filename.startswith(ours):
        return "ray_zero"
    for name in ("deepspeed", "torch/distributed", "torch/nn/parallel", "torch/optim", "transformers"):
        if f"/{name}/" in filename:
            return name
    return "torch (other Python)" if "/torch/" in filename else "C and the rest"


def profile_engine(spec, device, ours: str) -> dict:
    from ray_zero.measure.meter import Meter
    from ray_zero.train.worker import train

    profiler = cProfile.Profile()
    start, stop = Meter.start_timing, Meter.stop_timing

    def started(self, step):
        start(self, step)
        profiler.enable()

    def stopped(self, *args):
        profiler.disable()
        stop(self, *args)

    Meter.start_timing, Meter.stop_timing = started, stopped
    try:
        report = train(spec, 0, 1, device)
    finally:
        Meter.start_timing, Meter.stop_timing = start, stop
    steps = report["timed_steps"]
    by_package: dict[str, float] = defaultdict(float)
    mine: dict[str, float] = defaultdict(float)
    for (filename, line, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        where = package(filename, ours)
        by_package[where] += tottime / steps
        if where == "ray_zero":
            mine[f"{filename[len(ours) :]}:{line} {name}"] += tottime / steps
    return {
        "profiled_step_s": report["timed_s"] / steps,
        "by_package_s": dict(sorted(by_package.items(), key=lambda kv: -kv[1])),
        "ray_zero_functions_s": dict(sorted(mine.items(), key=lambda kv: -kv[1])[:12]),
    }


def bare_deepspeed_step_s(spec, device) -> float:
    """Seconds a step of a plain DeepSpeed loop takes (forward and loss, engine.backward, engine.step: what
    a user's own script does), with the module, batches, DeepSpeed config and warm-up and timed steps
    ray_zero's trial has: the floor a ray_zero step is compared with (issue 53: at most 1.5x on a GPU)."""
    import deepspeed
    import torch

    from ray_zero.models.describe import build_model_spec
    from ray_zero.models.spec import SYNTHETIC_BATCHES
    from ray_zero.train.data import synthetic_batches
    from ray_zero.train.ds_config import deepspeed_config
    from ray_zero.train.precision import cast_float_buffers
    from ray_zero.train.settings import EngineSettings

    experiment = spec.experiment
    torch.manual_seed(experiment.seed)
    model = build_model_spec(experiment.model_source())
    model.module.to(device).train()
    settings = EngineSettings.for_trial(spec, 1)
    cast_float_buffers(model.module, settings.precision, keep_norms=False)  # as DeepSpeedEngine does
    engine, _, _, _ = deepspeed.initialize(
        model=model.module,
        model_parameters=[p for p in model.module.parameters() if p.requires_grad],
        config=deepspeed_config(settings, model.module, device),
    )
    micro = spec.point.micro_batch_size
    batches = synthetic_batches(model.make_batch, micro, SYNTHETIC_BATCHES, experiment.seed, device)
    warmup, steps = experiment.warmup_steps, experiment.steps - experiment.warmup_steps

    def step(index: int) -> None:
        loss = model.loss(engine, batches[index % len(batches)])
        engine.backward(loss)
        engine.step()

    for index in range(warmup):
        step(index)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for index in range(steps):
        step(index)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    engine.destroy()
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="experiments/quick.yaml")
    parser.add_argument("--set", action="append", help=f"an experiment override (default: {' '.join(SEED)})")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--label", default="this")
    parser.add_argument("--output", required=True)
    parser.add_argument("--engine", help="BACKEND,STAGE: profile this one here (the script runs each so)")
    parser.add_argument(
        "--bare", action="store_true", help="DeepSpeed's engines: also time a plain DeepSpeed loop's step"
    )
    parser.add_argument("--engines", help="BACKEND,STAGE;...: these engines only (default: four)")
    args = parser.parse_args()
    args.set = args.set or SEED
    checkout = str(Path(args.checkout).resolve())
    sys.path.insert(0, checkout)
    gpu = args.device == "gpu"
    if args.engine is None:  # each engine in its own process
        out = {"checkout": checkout, "settings": args.set, "micro_batch": args.micro_batch, "engines": {}}
        engines = [tuple(e.split(",")) for e in args.engines.split(";")] if args.engines else ENGINES
        for backend, stage in engines:
            command = [sys.executable, __file__, *sys.argv[1:], "--engine", f"{backend},{stage}"]
            answer = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            out["engines"][f"{backend}_{stage}"] = profiled = json.loads(answer.splitlines()[-1])
            ours = profiled["by_package_s"].get("ray_zero", 0.0)
            print(
                f"{backend} {stage}: step {profiled['step_s'] * 1e3:.2f} ms unprofiled, "
                f"{profiled['profiled_step_s'] * 1e3:.2f} ms profiled, ray_zero's own {ours * 1e6:.0f} us "
                f"({ours / profiled['profiled_step_s']:.1%})",
                flush=True,
            )
            if "bare_step_s" in profiled:
                print(
                    f"    plain DeepSpeed loop: step {profiled['bare_step_s'] * 1e3:.2f} ms; ray_zero's "
                    f"{profiled['step_s'] / profiled['bare_step_s']:.3f}x of it",
                    flush=True,
                )
            for name, seconds in list(profiled["ray_zero_functions_s"].items())[:6]:
                print(f"    {seconds * 1e6:7.1f} us  {name}")
        Path(args.output).mkdir(parents=True, exist_ok=True)
        (Path(args.output) / f"profile-{args.label}.json").write_text(json.dumps(out, indent=1) + "\n")
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    from ray_zero.config import Point, TrialSpec
    from ray_zero.experiment_file import load_experiment
    from ray_zero.models.describe import describe_model

    if not gpu:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    experiment = load_experiment(Path(checkout) / args.experiment, args.set).with_absolute_paths()
    model = describe_model(experiment.model_source())
    device = torch.device("cuda:0" if gpu else "cpu")
    backend, stage = args.engine.split(",")
    point = Point(backend, int(stage), args.micro_batch, 1)
    spec = TrialSpec(experiment, point, experiment.resolved_precision(gpu), gpu, model, "unused")
    from ray_zero.train.worker import train

    plain = train(spec, 0, 1, device)  # unprofiled first: the process's one-off costs are paid there
    profiled = profile_engine(spec, device, os.path.join(checkout, "ray_zero") + os.sep)
    profiled["step_s"] = plain["timed_s"] / plain["timed_steps"]
    if args.bare and backend == "deepspeed":
        profiled["bare_step_s"] = bare_deepspeed_step_s(spec, device)
    dist.destroy_process_group()
    print(json.dumps(profiled))


if __name__ == "__main__":
    main()
