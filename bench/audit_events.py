"""Counts the Python audit events of the seed model's DeepSpeed step (stage 1, one rank), by event.

Since Python 3.12, importing filelock (which every Ray worker does; torch and DeepSpeed alone do not)
adds an audit hook, a Python function called at every audited event of the process, such as `id()`.

    python bench/audit_events.py [cpu|cuda] [--filelock]   # one JSON line: ms a step, then events a step by name

`--filelock` imports filelock first, as a Ray worker has, so that its hook (3.12+) is there while the
steps are timed; the timing comes before this script's own counting hook is added.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(kind: str, with_filelock: bool) -> None:
    if with_filelock:
        import filelock  # noqa: F401  (its audit hook is the point)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ray_zero.config import Experiment
    from ray_zero.model import build_model
    from ray_zero.worker import experiment_ds_config, jit_ops_dir

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", jit_ops_dir())  # as a rank: this environment's own op build

    device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if kind == "cuda" else "gloo")
    precision = "fp16" if kind == "cuda" else "fp32"
    model = build_model("seed").to(device)
    config = experiment_ds_config(Experiment(steps=1, warmup_steps=0), 1, 64, 1, precision)  # ray_zero's defaults
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    images = torch.randn(64, 1, 28, 28, device=device).to(torch.half if precision == "fp16" else torch.float)
    labels = torch.randint(0, 10, (64,), device=device)

    def step() -> None:
        loss = F.cross_entropy(engine(images).float(), labels)
        engine.backward(loss)
        engine.step()

    def timed(steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if kind == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / steps * 1e3

    for _ in range(10):
        step()
    block_ms = sorted(timed(200) for _ in range(5))  # ms a step in five blocks of 200, median reported
    counts: collections.Counter = collections.Counter()
    counting = [False]
    sys.addaudithook(lambda event, args: counting[0] and counts.update((event,)))
    steps = 50
    counting[0] = True
    counted_ms = timed(steps)
    counting[0] = False
    print(json.dumps({"device": kind, "python": sys.version.split()[0], "filelock_imported": "filelock" in sys.modules,
                      "filelock_version": getattr(sys.modules.get("filelock"), "__version__", None),
                      "filelock_fork_hook": "filelock._core._fork" in sys.modules and sys.version_info >= (3, 12),
                      "ms_per_step_blocks": [round(ms, 3) for ms in block_ms],
                      "ms_per_step_median": round(block_ms[2], 3),
                      "ms_per_step_while_counting": round(counted_ms, 3),
                      "events_per_step": {k: v / steps for k, v in counts.most_common()}}))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(next((a for a in args if a in ("cpu", "cuda")), "cpu"), "--filelock" in args)
