"""Times the seed model's first forward and backward (fp16, one GPU, no DeepSpeed) in a fresh process,
where cuDNN picks, and may compile at run time, its convolution and attention kernels; and where the
process runs it: a plain process, a Ray task's worker, or a Ray Train worker's training thread.

    python bench/first_step.py plain | ray-task | ray-train     # one JSON line each
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_step() -> dict:
    import torch
    import torch.nn.functional as F

    from ray_zero.model import build_model

    device = torch.device("cuda", torch.cuda.current_device())
    model = build_model("seed").to(device).half()
    images = torch.randn(64, 1, 28, 28, device=device, dtype=torch.half)
    labels = torch.randint(0, 10, (64,), device=device)
    torch.zeros(1, device=device).add_(1)  # the CUDA context, before the timing

    def timed(fn) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return round(time.perf_counter() - started, 4)

    loss = []
    forward = timed(lambda: loss.append(F.cross_entropy(model(images).float(), labels)))
    backward = timed(lambda: loss[0].backward())
    again = timed(lambda: F.cross_entropy(model(images).float(), labels).backward())
    return {"pid": os.getpid(), "thread": threading.current_thread().name, "cwd": os.getcwd(),
            "first_forward_s": forward, "first_backward_s": backward, "second_step_s": again,
            "env": dict(os.environ)}


def _in_ray_train() -> dict:
    import tempfile

    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(tempfile.mkdtemp()) / "first_step.json"  # one machine: the worker writes, we read

    def loop(config):
        Path(config["out"]).write_text(json.dumps(first_step()))

    TorchTrainer(loop, train_loop_config={"out": str(out)},
                 scaling_config=ScalingConfig(num_workers=1, use_gpu=True)).fit()
    return json.loads(out.read_text())


def main(where: str) -> None:
    if where == "plain":
        got = first_step()
    else:
        import ray

        ray.init(num_gpus=1, num_cpus=2, configure_logging=False, log_to_driver=False)
        if where == "ray-task":
            got = ray.get(ray.remote(num_gpus=1, max_calls=1)(first_step).remote())
        else:
            got = _in_ray_train()
        ray.shutdown()
    env = got.pop("env")
    got["env_differs"] = {k: v for k, v in env.items() if os.environ.get(k) != v and not k.startswith("RAY_")}
    got["env_missing"] = sorted(k for k in os.environ if k not in env)
    print(json.dumps({"where": where, **got}))


if __name__ == "__main__":
    main(sys.argv[1])
