"""What one trial's set-up (model build, deepspeed.initialize) costs when K single-rank trials set up on
one GPU at once, against one alone; and whether the host's CPUs or the GPU is what they queue for
(bench/sweep_waves.md).

    python bench/setup_contention.py --experiment experiments/zoo_swin_t.yaml --engine deepspeed,3 \
        --counts 1,8,16 --output OUT [--cpus 4] [--checkout OLD_CHECKOUT] [--set KEY=VALUE ...]

Each round starts K processes (world size 1, each its own process group), which import, describe the
model and build their trial's spec, then meet at one barrier and run ray_zero.train.worker.train (the
function a Ray Train worker runs) with the GPU's measurement turn, as a sweep's trials do: set-ups side
by side, warm-up and timed steps in turns. Printed per round: each rank's model build and initialize
seconds (median and largest), and the seconds from the barrier to the last set-up's end. `--cpus N` pins
the round's processes to the first N CPUs: the host more crowded, the GPU's work the same.
Written: OUT/setup-LABEL.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, free_port, machine, versions

SHORT = ["steps=4", "warmup_steps=1"]
"""Turns as short as a timed window allows: the set-ups are what is measured here."""


def rank(checkout, experiment_path, overrides, engine, micro_batch, cpus, gpu, barrier, results) -> None:
    sys.path.insert(0, checkout)
    if cpus:
        os.sched_setaffinity(0, range(cpus))
    port = str(free_port())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    from ray_zero.config import Point, TrialSpec
    from ray_zero.experiment_file import load_experiment
    from ray_zero.models.describe import describe_model
    from ray_zero.train.worker import train

    if not gpu:  # a check of the script on a machine without a GPU (no turn there)
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    experiment = load_experiment(experiment_path, overrides).with_absolute_paths()
    backend, stage = engine.split(",")
    point = Point(backend, int(stage), micro_batch, 1)
    model = describe_model(experiment.model_source())
    spec = TrialSpec(experiment, point, experiment.resolved_precision(gpu), gpu, model, "unused")
    device = torch.device("cuda:0" if gpu else "cpu")
    if gpu:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the CUDA context before the barrier, as a trial's process has it
    barrier.wait()
    started = time.time()
    report = train(spec, 0, 1, device)
    results.put(
        {
            "started": started,
            "model_build_s": report["model_build_s"],
            "initialize_s": report["initialize_s"],
            "set_up_until": report["set_up_until"],
        }
    )
    dist.destroy_process_group()


def run_round(args, count: int) -> dict:
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(count), context.Queue()
    experiment = str((ROOT / args.experiment).resolve())
    workers = [
        context.Process(
            target=rank,
            args=(
                str(Path(args.checkout).resolve()), experiment, SHORT + args.set, args.engine,
                args.micro_batch, args.cpus, args.device == "gpu", barrier, results,
            ),
        )
        for _ in range(count)
    ]
    for worker in workers:
        worker.start()
    ranks = []
    while len(ranks) < count:
        try:
            ranks.append(results.get(timeout=5))
        except queue.Empty:
            if any(worker.exitcode not in (None, 0) for worker in workers):
                for worker in workers:
                    worker.terminate()
                raise SystemExit(f"a rank of the round of {count} failed: its error is printed above")
    for worker in workers:
        worker.join()
    start = min(r["started"] for r in ranks)
    build = [r["model_build_s"] for r in ranks]
    initialize = [r["initialize_s"] for r in ranks]
    return {
        "count": count,
        "cpus": args.cpus or os.cpu_count(),
        "model_build_s_median": statistics.median(build),
        "model_build_s_max": max(build),
        "initialize_s_median": statistics.median(initialize),
        "initialize_s_max": max(initialize),
        "last_set_up_end_s": max(r["set_up_until"] for r in ranks) - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="experiments/zoo_swin_t.yaml")
    parser.add_argument("--engine", default="deepspeed,3", help="BACKEND,STAGE")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--counts", default="1,8,16", help="processes that set up at once, per round")
    parser.add_argument("--cpus", type=int, default=0, help="pin every round's processes to the first N CPUs")
    parser.add_argument("--set", action="append", default=[], help="an experiment override")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--checkout", default=str(ROOT), help="another checkout's ray_zero (the one before)")
    parser.add_argument("--label", default="run")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    rounds = []
    for count in (int(c) for c in args.counts.split(",")):
        rounds.append(run_round(args, count))
        r = rounds[-1]
        print(
            f"{args.engine} x{count} on {r['cpus']} CPUs: build {r['model_build_s_median']:.2f} s "
            f"(max {r['model_build_s_max']:.2f}), initialize {r['initialize_s_median']:.2f} s "
            f"(max {r['initialize_s_max']:.2f}), last set-up done {r['last_set_up_end_s']:.1f} s after the "
            "barrier",
            flush=True,
        )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    about = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), **versions()}
    record = json.dumps({"about": about, "settings": settings, "rounds": rounds}, indent=1)
    (out / f"setup-{args.label}.json").write_text(record + "\n")


if __name__ == "__main__":
    main()
