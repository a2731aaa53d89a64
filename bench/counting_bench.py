"""Does counting the collectives still change what is timed? Samples/s per engine with the counting as
it is now (after the timed window), without any counting, and as it was (issue 53, part 1).

    python bench/counting_bench.py --output OUT                                   # 2 CPU ranks
    python bench/counting_bench.py --device gpu --workers 1 --experiment experiments/gpt2_zero.yaml \\
        --micro-batch 4 --engines deepspeed:0,deepspeed:1 --output OUT            # one GPU, some engines

Three modes, each run `--reps` times per engine, the modes' order turned each round:

- new: this checkout as it is: the timed steps run torch.distributed's own functions and stock DDP; the
  collectives are counted in 3 untimed steps after the window (ray_zero/train/comm.py).
- off: the same with no counted steps (nothing counted at all): the stock baseline.
- old: the behaviour before: ray_zero/train/comm.py's wrappers in torch.distributed from before the
  engine starts to the process's end (DeepSpeed's backend holds them), counting and timing every
  collective (CUDA events on a GPU) in the timed steps, and DDP's all-reduce through torch's Python
  allreduce_hook.

`new` and `off` run in one set of rank processes that never hold a wrapper outside the counted steps;
`old` in another set, started beside it (the wrappers it installs never leave its processes). Each run is
ray_zero.train.worker.train, the function a Ray Train worker runs, without Ray. Written: OUT/runs.jsonl (a
line per run; runs are added to those of earlier calls with the same OUT, so the engines can be run
in several calls) and OUT/table.md (hardware, versions, date, command; per engine each mode's median
samples/s summed over ranks, its min-max over the runs, and new/off and old/off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
from pathlib import Path

from common import ROOT, free_port

sys.path.insert(0, str(ROOT))

from ray_zero.config import Point, TrialSpec  # noqa: E402
from ray_zero.experiment_file import load_experiment  # noqa: E402
from ray_zero.models.describe import describe_model  # noqa: E402

ENGINES = [("deepspeed", 0), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3)]
ENGINES += [("torch_zero", 0), ("torch_zero", 1), ("fsdp", 2), ("fsdp", 3)]
NAMES = {"deepspeed": "DeepSpeed ZeRO-{}", "torch_zero": ("DDP", "DDP + ZeRO-1"), "fsdp": "FSDP2 stage {}"}
MODES = ("new", "off", "old")
KEEP = ("rank", "samples_per_s", "step_median_s", "step_spread", "timed_steps", "timed_s", "step_s")


def engine_name(backend: str, stage: int) -> str:
    name = NAMES[backend]
    return name[stage] if isinstance(name, tuple) else name.format(stage)


def _old_behaviour(device) -> None:
    """The counting as it was: wrappers on for the whole process, DDP through the Python hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ray_zero.train import comm, worker
    from ray_zero.train.torch_engines import TorchZeroEngine

    if getattr(_old_behaviour, "on", False):
        return
    comm.counting(comm.CommCounter(device)).__enter__()  # never left: as comm.install() was
    build = worker.build_engine

    def with_hook(model, settings, device):
        engine = build(model, settings, device)
        if isinstance(engine, TorchZeroEngine):
            engine.model.register_comm_hook(None, default_hooks.allreduce_hook)
        return engine

    worker.build_engine, _old_behaviour.on = with_hook, True


def _run(rank: int, world_size: int, spec: TrialSpec, mode: str) -> dict:
    import torch

    from ray_zero.train import steps, worker

    device = torch.device(f"cuda:{rank}") if spec.use_gpu else torch.device("cpu")
    if mode == "old":
        _old_behaviour(device)
    steps.COUNTED_STEPS = 3 if mode == "new" else 0
    report = worker.train(spec, rank, world_size, device)
    return {key: report.get(key) for key in KEEP}


def _rank_main(rank: int, world_size: int, port: int, gpu: bool, connection) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )  # fmt: skip
    if not gpu:
        torch.set_num_threads(1)  # as a Ray Train worker with one CPU
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world_size)
    connection.send("ready")
    while (job := connection.recv()) is not None:
        try:
            connection.send(("ok", _run(rank, world_size, *job)))
        except Exception as error:  # the bench records it and goes on
            connection.send(("error", f"{type(error).__name__}: {error}"))
    dist.destroy_process_group()


class Ranks:
    """`world_size` processes under torch.distributed, kept for every run of one set of modes."""

    def __init__(self, world_size: int, gpu: bool):
        port = free_port()
        context = mp.get_context("spawn")
        self.connections, self.processes = [], []
        for rank in range(world_size):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=_rank_main, args=(rank, world_size, port, gpu, theirs), daemon=True
            )
            process.start()
            self.connections.append(mine)
            self.processes.append(process)
        for connection in self.connections:
            connection.recv()

    def run(self, spec: TrialSpec, mode: str) -> list:
        for connection in self.connections:
            connection.send((spec, mode))
        return [connection.recv() for connection in self.connections]

    def stop(self) -> None:
        for connection, process in zip(self.connections, self.processes):
            connection.send(None)
            process.join(timeout=30)


def environment(gpu: bool) -> str:
    import deepspeed
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    hardware = torch.cuda.get_device_name(0) if gpu else f"{os.cpu_count()} vCPUs ({cpu})"
    return (
        f"{hardware}; Python {platform.python_version()}, torch {torch.__version__}, DeepSpeed "
        f"{deepspeed.__version__}, Transformers {transformers.__version__}; "
        f"{datetime.date.today().isoformat()}"
    )


def table(runs: list[dict], header: str) -> str:
    """Per engine: each mode's median samples/s (summed over ranks) with its min-max over the runs, and
    new / off and old / off per round (a mode's run over the other mode's run beside it: the host's load
    drifts over minutes, the pair shares it): their median and min-max."""
    lines = [
        header,
        "",
        "| engine | off: samples/s (min-max) | new | old | new / off per round: median (min-max) "
        "| old / off per round: median (min-max) |",
        "|---|---|---|---|---|---|",
    ]
    for backend, stage in ENGINES:
        mine = [r for r in runs if (r["backend"], r["stage"]) == (backend, stage)]
        by = {(r.get("call", ""), r["rep"], r["mode"]): r["samples_per_s"] for r in mine}
        rates = {mode: [v for (_, _, m), v in by.items() if m == mode] for mode in MODES}
        if not any(rates.values()):
            continue  # not run
        if not all(rates.values()):
            lines.append(f"| {engine_name(backend, stage)} | failed | | | | |")
            continue
        cells = [
            f"{statistics.median(rates[m]):.1f} ({min(rates[m]):.1f}-{max(rates[m]):.1f})" for m in MODES
        ]
        ratios = []
        for mode in ("new", "old"):
            paired = [
                by[c, rep, mode] / by[c, rep, "off"]
                for c, rep, m in by
                if m == "off" and (c, rep, mode) in by
            ]
            ratios.append(f"{statistics.median(paired):.3f} ({min(paired):.2f}-{max(paired):.2f})")
        lines.append(
            f"| {engine_name(backend, stage)} | {cells[1]} | {cells[0]} | {cells[2]} | {' | '.join(ratios)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default="experiments/speed_cpu.yaml")
    parser.add_argument("--set", action="append", default=[], help="an experiment override, KEY=VALUE")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=4, help="runs of each engine in each mode")
    parser.add_argument("--engines", help="BACKEND:STAGE,... (default: all eight)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--summarize", action="store_true", help="the table again from OUT/runs.jsonl")
    args = parser.parse_args()
    gpu = args.device == "gpu"
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        runs = [json.loads(line) for line in open(out / "runs.jsonl")]
        header = (out / "table.md").read_text().split("\n\n")[0]
        (out / "table.md").write_text(table([r for r in runs if not r["errors"]], header) + "\n")
        print((out / "table.md").read_text())
        return
    experiment = load_experiment(ROOT / args.experiment, args.set).with_absolute_paths()
    precision = experiment.resolved_precision(gpu)
    model = describe_model(experiment.model_source())
    engines = (
        [(b, int(s)) for b, s in (e.split(":") for e in args.engines.split(","))] if args.engines else ENGINES
    )
    groups = {"stock": Ranks(args.workers, gpu), "old": Ranks(args.workers, gpu)}
    call = datetime.datetime.now().isoformat(timespec="seconds")
    with open(out / "runs.jsonl", "a") as log:
        for rep in range(args.reps):
            for backend, stage in engines:
                point = Point(backend, stage, args.micro_batch, args.workers)
                spec = TrialSpec(experiment, point, precision, gpu, model, storage_path="unused")
                for mode in MODES if rep % 2 == 0 else reversed(MODES):
                    answers = groups["old" if mode == "old" else "stock"].run(spec, mode)
                    errors = [value for status, value in answers if status == "error"]
                    ranks = [value for status, value in answers if status == "ok"]
                    record = {"call": call, "rep": rep, "backend": backend, "stage": stage, "mode": mode}
                    record["errors"] = errors
                    record["samples_per_s"] = sum(r["samples_per_s"] for r in ranks) if not errors else None
                    record["ranks"] = ranks
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    print(
                        rep,
                        engine_name(backend, stage),
                        mode,
                        errors or f"{record['samples_per_s']:.1f}",
                        flush=True,
                    )
    for group in groups.values():
        group.stop()
    with open(out / "commands.txt", "a") as commands:  # every call that added runs to OUT
        commands.write("python bench/counting_bench.py " + " ".join(sys.argv[1:]) + "\n")
    called = "; ".join(f"`{line}`" for line in (out / "commands.txt").read_text().splitlines())
    header = (
        f"{environment(gpu)}; {model.description}, micro-batch {args.micro_batch}, {args.workers} "
        f"rank(s), {precision}, {experiment.steps} steps ({experiment.warmup_steps} warm-up), {args.reps} "
        f"runs per engine and mode. Commands: {called}"
    )
    runs = [json.loads(line) for line in open(out / "runs.jsonl")]
    text = table([r for r in runs if not r["errors"]], header)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
