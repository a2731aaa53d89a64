"""Times the seed model's first patch-embedding convolution in a fresh process: forward and backward,
fp16, on the GPU, as a rank's first step runs it (cuDNN picks, and may compile, its kernels then).

    python bench/first_conv.py            # prints one JSON line: seconds of the first and second call
"""
from __future__ import annotations

import json
import os
import time

import torch

from ray_zero.model import build_model


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.init()
    conv = build_model("seed").patch_embed.to(device).half()
    images = torch.randn(64, 1, 28, 28, device=device, dtype=torch.half)
    torch.zeros(1, device=device).add_(1)  # the CUDA context, before the timing
    first_forward = timed(lambda: conv(images))
    first_backward = timed(lambda: conv(images).float().sum().backward())
    second = timed(lambda: conv(images).float().sum().backward())
    print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "first_forward_s": round(first_forward, 4),
                      "first_backward_s": round(first_backward, 4), "second_forward_backward_s": round(second, 4),
                      "cudnn": torch.backends.cudnn.version()}))


if __name__ == "__main__":
    main()
