"""One grid point as bare DeepSpeed under torchrun (bench.run_bare), printed as one line: for the
diagnosis scripts (scripts/gpu-diagnose.sh, scripts/gpu-host-bound.sh, which set BARE_* switches, and
scripts/gpu-bare-pair.sh). The timed steps' wall-clock interval ends the line.

    python bench/bare_once.py experiments/quick.yaml --label "seed bare" --workers 2 --set steps=300
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from bench import run_bare, thread_figures  # noqa: E402
from ray_zero.config import load_experiment  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment")
    parser.add_argument("--label", required=True)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="as for ray_zero sweep")
    args = parser.parse_args()
    experiment = load_experiment(args.experiment, args.overrides).with_absolute_data_dir()
    use_gpu = torch.cuda.is_available()
    point = {"stage": args.stage, "micro_batch_size": args.micro_batch, "num_workers": args.workers}
    row = run_bare(experiment, point, "fp16" if use_gpu else "fp32", use_gpu, Path(tempfile.mkdtemp()))
    thread = thread_figures(row["per_rank"])  # the rank whose training thread fared worst
    print(f"{args.label}: {row['samples_per_s']:.1f} samples/s, thread CPU {thread['thread_cpu_ms_per_step']:.3f} ms "
          f"a step, blocks {thread['thread_blocks_per_step']:.3f} a step, timed {row['timed_s']:.2f} s, "
          f"wall {row['wall_s']:.1f} s, timed steps from {row['finished_at'] - row['timed_s']:.1f} "
          f"to {row['finished_at']:.1f}", flush=True)


if __name__ == "__main__":
    main()
