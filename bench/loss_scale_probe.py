"""DeepSpeed fp16 stage 0's loss scaling: ray_zero/train/ds_compat.py's probe (one SGD step of a tiny
fp16 stage-0 engine, the update over the true gradient, with and without the loss scaled), then ray_zero's
DeepSpeed engine training a small model in fp16 at stage 0: what it reports and its losses. One process.
On a GPU fp16 is DeepSpeed's own; on a CPU without oneDNN fp16 DeepSpeed's accelerator refuses it, and
this lifts that one flag, as tests/test_ds_compat.py does (the output says so).

    python bench/loss_scale_probe.py                                        # CPU
    source scripts/gpu-env.sh; NO_RAY=1 python bench/loss_scale_probe.py   # one GPU
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main() -> None:
    import deepspeed
    from test_engines import toy_spec

    from ray_zero.train import ds_compat
    from ray_zero.train.engines import build_engine
    from ray_zero.train.settings import EngineSettings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29617", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    lifted = device.type == "cpu"
    if lifted:
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    unscaled = ds_compat.fp16_update_ratio(device, scale_loss=False)
    scaled = ds_compat.fp16_update_ratio(device, scale_loss=True)
    settings = EngineSettings(stage=0, precision="fp16", micro_batch_size=8, world_size=1)
    losses, said = {}, None
    for scale in (True, False):  # as measured; then the loss left as it is (the version check's default)
        engine = build_engine(toy_spec(), settings, device)
        said = said or engine.loss_scale_fix
        engine._scale_loss = engine._scale_loss and scale
        x, y = engine.spec.make_batch(8, device, torch.Generator().manual_seed(0))
        run = []
        for _ in range(20):
            run.append(float(engine.forward_backward((x.to(engine.input_dtype), y), boundary=True)))
            engine.step()
        losses["with ray_zero's decision" if scale else "loss left unscaled"] = [run[0], run[-1]]
        engine.close()
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "deepspeed": deepspeed.__version__,
                "update_over_true_gradient": {"loss as is": unscaled[0], "loss scaled": scaled[0]},
                "optimizer": unscaled[1],
                "fp16 flag lifted": lifted,
                "loss_scale_fix": said,
                "loss over 20 steps of one batch, first and last": losses,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
