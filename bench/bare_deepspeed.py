"""Bare DeepSpeed under torchrun, no Ray: the baseline that bench/bench.py compares ray_zero against.

Each rank runs the very same `ray_zero.train.worker.train` as a Ray Train worker, on the same TrialSpec (built
once by the launching process and pickled), with the same diagnostics marks; only the launcher differs:

    torchrun --standalone --nproc_per_node 2 bench/bare_deepspeed.py SPEC.pkl OUT_DIR

Each rank writes its measurements, its diagnostics included, to OUT_DIR/rank{N}.json.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ray_zero.measure.diagnostics import Diagnostics
from ray_zero.train.worker import train


def main(spec_path: str, out_dir: str) -> None:
    spec = pickle.loads(Path(spec_path).read_bytes())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec.use_gpu:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    # Made here, as Ray Train's worker makes it: its first mark (train_loop_started_at) means "the
    # launcher's process is up, with its process group", under both launchers.
    diagnostics = Diagnostics()
    metrics = train(spec, rank, world_size, device, diagnostics=diagnostics)
    metrics["diagnostics"] = diagnostics.result()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(metrics, default=str))
    dist.barrier()  # no rank exits while another may still be in a collective


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # Skip interpreter teardown: with 2 CPU ranks, DeepSpeed's shm comm op sometimes aborts in its native
    # destructors at exit ("terminate called without an active exception"), after the work is written.
    # Ray's workers are ended the same abrupt way.
    sys.stdout.flush()
    os._exit(0)
