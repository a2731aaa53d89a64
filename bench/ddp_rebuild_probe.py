"""When does DDP hold one more fp32 copy of its gradients during the warm-up? (a GPU diagnostic)

    python bench/ddp_rebuild_probe.py [--repeats 4] [--steps 5]

On an H200 the whole-trial peak of DDP rows (torch_zero) was, in some trials and not in others of the
same configuration, the timed steps' peak plus 4 bytes per parameter (docs/h200-results.md). DDP rebuilds
its gradient buckets at its second iteration. This runs ray_zero's own DDP set-up (a BERT-base masked LM,
bf16 autocast, AdamW, DDP with the allreduce comm hook the engine registers) on one GPU, world size 1,
and prints each iteration's peak allocated above the iteration's start, for several fresh models, with
Python's garbage collector as it is, disabled, or run after every step; and without the comm hook. If
the extra copy follows the collector, the old buckets are freed by it (a reference cycle), not by DDP.
No Ray, no DeepSpeed.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1024**3


def run(mode: str, steps: int, micro_batch: int) -> list[tuple[float, float]]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    from transformers import BertConfig, BertForMaskedLM

    device = torch.device("cuda", 0)
    with torch.device(device):
        model = BertForMaskedLM(BertConfig(vocab_size=30522, max_position_embeddings=512))
    ddp = DistributedDataParallel(model, device_ids=[device])
    if mode != "no hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 30522, (micro_batch, 512), device=device)
    peaks = []
    for _ in range(steps):  # (iteration start, its peak above that start), GiB
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peaks.append((start / GIB, (torch.cuda.max_memory_allocated() - start) / GIB))
        if mode == "gc after each step" or (mode == "gc after step 1" and len(peaks) == 1):
            gc.collect()
    del ddp, model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return peaks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=8)
    modes = ["as is", "gc disabled", "gc after each step", "gc after step 1", "no hook"]
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    for mode in args.modes:
        for repeat in range(args.repeats):
            if mode == "gc disabled":
                gc.disable()
            peaks = run(mode, args.steps, args.micro_batch)
            gc.enable()
            marks = "  ".join(f"{start:.3f}+{rise:.3f}" for start, rise in peaks)
            print(f"{mode:18s} #{repeat}: start + rise per iteration, GiB: {marks}", flush=True)
    print(f"(4 bytes per parameter of BERT-base: {4 * 109.5e6 / GIB:.3f} GiB)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
