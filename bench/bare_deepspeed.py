"""Bare DeepSpeed under torchrun, no Ray: the baseline that bench/bench.py compares ray_zero against.

Same model, data, DeepSpeed config and timing code (ray_zero.worker.train), only the launcher differs:

    torchrun --standalone --nproc_per_node 2 bench/bare_deepspeed.py TRIAL.json OUT.json

TRIAL.json holds what a ray_zero trial gets (experiment, point, precision, use_gpu); rank 0 writes
every rank's measurements to OUT.json.

Two switches make the bare run set up like a Ray Train worker, to find what a difference between the
launchers comes from: BARE_LAZY_PROCESS_GROUP=1 creates the NCCL process group without `device_id`
(as Ray Train's TorchConfig does: communicators are created at the first collective), and
BARE_TRAIN_THREAD=1 trains in a second thread (Ray Train runs the training function in one).
Two more put Ray into the bare process: BARE_IMPORT_RAY=1 imports Ray, Ray Tune and Ray Train's torch
module before torch (a Ray worker has them loaded first: twice the modules), and BARE_RAY_INIT=1 also
starts a private Ray and connects this process to it as its driver (Ray's core worker and its threads
in the process, as in a Ray worker), before training.
"""
from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

RAY_INIT = os.environ.get("BARE_RAY_INIT") == "1"
if RAY_INIT or os.environ.get("BARE_IMPORT_RAY") == "1":
    import ray  # noqa: F401  (before torch, as in a Ray worker)
    import ray.train.torch  # noqa: F401
    import ray.tune  # noqa: F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ray_zero.clock import process_started_at  # noqa: E402
from ray_zero.worker import train  # noqa: E402


def main(trial_path: str, out_path: str) -> None:
    imported_at = time.time()  # torch and ray_zero.worker imported
    trial = json.load(open(trial_path))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if trial["use_gpu"]:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        lazy = os.environ.get("BARE_LAZY_PROCESS_GROUP") == "1"
        dist.init_process_group("nccl", device_id=None if lazy else device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    process_group_at = time.time()
    if RAY_INIT:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    if os.environ.get("BARE_TRAIN_THREAD") == "1":
        with ThreadPoolExecutor(1) as pool:
            metrics = pool.submit(train, trial, rank, world_size, device).result()
    else:
        metrics = train(trial, rank, world_size, device)
    if RAY_INIT:
        ray.shutdown()  # the process ends with os._exit, which would leave the private Ray running
    metrics.update(process_started_at=process_started_at(), imported_at=imported_at,
                   process_group_at=process_group_at)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, metrics)
    if rank == 0:
        with open(out_path, "w") as out:
            json.dump({"ranks": gathered, "written_at": time.time()}, out)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # Skip interpreter teardown: with 2 CPU ranks, DeepSpeed's shm comm op sometimes aborts in its
    # native destructors at exit ("terminate called without an active exception"), after the work
    # is done and written. Ray's workers are ended the same abrupt way.
    sys.stdout.flush()
    os._exit(0)
