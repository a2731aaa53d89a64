"""Counts the Python audit events of the seed model's DeepSpeed step (stage 1, one rank), by event.

Since Python 3.12, importing filelock (which every Ray worker does; torch and DeepSpeed alone do not)
adds an audit hook, a Python function called at every audited event of the process, such as `id()`.

    python bench/audit_events.py [cpu|cuda]     # one JSON line: events a step by name, ms a step
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(kind: str) -> None:
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

    for _ in range(10):
        step()
    counts: collections.Counter = collections.Counter()
    counting = [False]
    sys.addaudithook(lambda event, args: counting[0] and counts.update((event,)))
    steps = 50
    counting[0] = True
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if kind == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    counting[0] = False
    print(json.dumps({"device": kind, "python": sys.version.split()[0], "filelock_imported": "filelock" in sys.modules,
                      "ms_per_step": round(elapsed / steps * 1e3, 3),
                      "events_per_step": {k: v / steps for k, v in counts.most_common()}}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
