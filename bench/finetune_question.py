"""The longest sequence that fits one GPU, per engine, stage, GPU count and checkpointing: `estimate`'s
own fit rule (the peak at its error band's upper end, the allocator's reserve and the CUDA context within
the GPU's memory), searched over seq_len, beside DeepSpeed's estimator (issue 66, item 4).

    python bench/finetune_question.py experiments/llama_8b_lora.yaml --gpu h100 --gpu-gib 79.18 \
        --output bench/results/finetune-question-cpu-2core

A prediction, no GPU needed: every length is `ray_zero.estimate` at micro-batch 1 (its step traced on the
meta device). First the doubling grid of --lengths for every point at once; then, per point, the line
through the needed GiB at the bracket's two ends guesses the crossing, and the guess and the length one
--step above it are estimated; the bracket shrinks until its ends are one --step apart: the answer fits
and the length one step longer does not, both by `estimate`'s `fits` column.

Beside each answer: ray_zero's model states per rank for the run as configured (LoRA: frozen weights
apart), and DeepSpeed's `estimate_zero2_model_states_mem_needs_all_cold` /
`estimate_zero3_model_states_mem_needs_all_cold` (no offload) given the full parameter count: they count
every parameter as trained and know no sequence length (DeepSpeed #5304). Writes finetune_question.md and
.csv in --output and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import numbers
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd

try:
    import ray_zero
except ModuleNotFoundError:  # a checkout: the package beside bench/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ray_zero
from ray_zero.experiment_file import load_experiment
from ray_zero.measure import error_band

STAGES = {"deepspeed": (0, 1, 2, 3), "fsdp": (2, 3), "torch_zero": (0, 1)}
ENGINE = {"deepspeed": "DeepSpeed ZeRO-{}", "fsdp": "FSDP2 (stage {})", "torch_zero": "DDP{}"}


@dataclass
class Search:
    """One point's search: the longest length known to fit (lo) and the shortest known not to (hi)."""

    backend: str
    stage: int
    workers: int
    checkpointing: bool
    needed: dict = field(default_factory=dict)  # seq_len -> GiB estimate's fit rule compares
    verdict: dict = field(default_factory=dict)  # seq_len -> True (fits) / False
    rows: dict = field(default_factory=dict)  # seq_len -> estimate's row

    @property
    def lo(self) -> Optional[int]:
        return max((n for n, ok in self.verdict.items() if ok), default=None)

    @property
    def hi(self) -> Optional[int]:
        return min((n for n, ok in self.verdict.items() if not ok), default=None)

    def next_lengths(self, step: int, budget: float) -> list[int]:
        """The lengths to estimate next: none once the bracket is one step wide (or open)."""
        lo, hi = self.lo, self.hi
        if lo is None or hi is None or hi - lo <= step:
            return []
        a, b = self.needed.get(lo), self.needed.get(hi)
        guess = (lo + hi) / 2 if a is None or b is None or b <= a else lo + (budget - a) * (hi - lo) / (b - a)
        start = min(max(int(guess) // step * step, lo + step), hi - step)
        return [n for n in (start, start + step) if n < hi]


def longest(
    experiment,
    *,
    gpu: str,
    gpu_gib: float,
    lengths,
    step: int,
    workers,
    backends,
    checkpointing=(False, True),
    log=print,
) -> list[Search]:
    """Every (backend, stage, workers, checkpointing) point's search, run to its end."""
    searches = {
        (b, s, w, c): Search(b, s, w, c)
        for b in backends
        for s in STAGES[b]
        for w in workers
        for c in checkpointing
    }
    column = f"fits_{gpu_gib:g}_gib"

    def run(backend, stages, counts, checks, seq_lens):
        started = time.time()
        result = ray_zero.estimate(
            experiment,
            backend=backend,
            stages=sorted(stages),
            workers=sorted(counts),
            micro_batch_size=1,
            seq_len=sorted(seq_lens),
            gpu=gpu,
            gpu_gib=gpu_gib,
            overrides=[
                f"grid.activation_checkpointing=[{', '.join(str(c).lower() for c in sorted(checks))}]"
            ],
        )
        for row, fits in zip(result.rows, result.table[column]):
            key = (row["backend"], row["stage"], row["num_workers"], bool(row["activation_checkpointing"]))
            if key in searches:
                n = row["seq_len"]
                searches[key].verdict[n] = fits == "yes"
                searches[key].rows[n] = row
                searches[key].needed[n] = error_band.needed_gib(row["predicted_peak_high_gib"])
        took = time.time() - started
        log(f"{backend}, checkpointing {sorted(checks)}: seq_len {sorted(seq_lens)} in {took:.0f} s")

    for backend in backends:  # the doubling grid: one call per engine, both checkpointing settings
        run(backend, STAGES[backend], workers, checkpointing, lengths)
    for _ in range(12):  # each round narrows every open bracket by at least one step
        wanted: dict = {}
        for s in searches.values():
            more = s.next_lengths(step, gpu_gib)
            if more:
                group = wanted.setdefault((s.backend, s.checkpointing), [set(), set(), set()])
                group[0].add(s.stage), group[1].add(s.workers), group[2].update(more)
        if not wanted:
            break
        for (backend, check), (stages, counts, seq_lens) in sorted(wanted.items()):
            run(backend, stages, counts, [check], seq_lens)
    for s in searches.values():
        if s.hi is not None and any(ok and n > s.hi for n, ok in s.verdict.items()):
            log(f"warning: {s.backend} {s.stage} x{s.workers}: fits is not monotone in seq_len: {s.verdict}")
    return list(searches.values())


def deepspeed_says(stage: int, params: int, largest_layer: int, gpus: int) -> Optional[float]:
    """DeepSpeed's own estimator's GiB per GPU, no offload (stage 2 or 3; none for 0 and 1), as it prints."""
    if stage not in (2, 3):
        return None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

            estimate_zero2_model_states_mem_needs_all_cold(params, num_gpus_per_node=gpus, num_nodes=1)
            wanted = "offload_optimizer=none"
        else:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

            estimate_zero3_model_states_mem_needs_all_cold(
                params, largest_layer, num_gpus_per_node=gpus, num_nodes=1
            )
            wanted = "offload_param=none, offload_optimizer=none, zero_init=1"
    line = next(x for x in out.getvalue().splitlines() if x.rstrip().endswith(wanted))
    return float(re.findall(r"([\d.]+)GB", line)[1])  # per CPU | per GPU | options


def largest_layer(experiment) -> int:
    """The most parameters one module holds itself (DeepSpeed's largest_layer_params): built on meta."""
    import torch
    import transformers

    kind = experiment.model.split(":", 1)[1]
    config = transformers.AutoConfig.for_model(kind, **experiment.model_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def table(searches: list[Search], largest: int) -> pd.DataFrame:
    out = []
    for s in searches:
        row = s.rows[s.lo] if s.lo is not None else next(iter(s.rows.values()))
        answer = s.lo if s.lo is not None else f"< {min(s.verdict)}"
        if s.hi is None:
            answer = f">= {s.lo}"
        out.append(
            {
                "engine": ENGINE[s.backend].format(
                    s.stage if s.backend != "torch_zero" else " + ZeRO opt" * s.stage
                ),
                "backend": s.backend,
                "stage": s.stage,
                "gpus": s.workers,
                "checkpointing": s.checkpointing,
                "longest_seq_len": answer,
                "needed_gib": round(s.needed[s.lo], 2) if s.lo is not None else None,
                "next_seq_len": s.hi,
                "next_needed_gib": round(s.needed[s.hi], 2) if s.hi is not None else None,
                "peak_gib": round(row["predicted_peak_gib"], 2) if s.lo is not None else None,
                "model_states_gib": round(row["predicted_model_state_gib"], 3),
                "params": row["params"],
                "deepspeed_estimator_gib": deepspeed_says(s.stage, row["params"], largest, s.workers)
                if s.backend == "deepspeed"
                else None,
                "lengths_estimated": len(s.verdict),
            }
        )
    return pd.DataFrame(out)


def compact(frame: pd.DataFrame) -> str:
    """Rows engine, columns GPU count, cells `checkpointing off / on` in tokens; then the states."""
    head = (
        "| engine | "
        + " | ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in sorted(frame.gpus.unique()))
        + " |"
    )
    lines = [head, "|---" * (frame.gpus.nunique() + 1) + "|"]
    for engine, group in frame.groupby("engine", sort=False):
        cells = []
        for n in sorted(frame.gpus.unique()):
            at = group[group.gpus == n].set_index("checkpointing")["longest_seq_len"]
            cells.append(f"{_k(at.get(False))} / {_k(at.get(True))}")
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def states(frame: pd.DataFrame) -> str:
    ds = frame[frame.backend == "deepspeed"].drop_duplicates(["stage", "gpus"])
    lines = [
        "| DeepSpeed stage | GPUs | ray_zero model states GiB/GPU (LoRA) "
        "| DeepSpeed estimator GiB/GPU (all trained) |",
        "|---|---|---|---|",
    ]
    for row in ds.itertuples():
        said = (
            "no estimator" if pd.isna(row.deepspeed_estimator_gib) else f"{row.deepspeed_estimator_gib:.2f}"
        )
        lines.append(f"| {row.stage} | {row.gpus} | {row.model_states_gib:.2f} | {said} |")
    return "\n".join(lines)


def markdown(frame: pd.DataFrame) -> str:
    rows = [list(frame.columns), ["---"] * len(frame.columns)]
    rows += [["-" if pd.isna(v) else v for v in r] for r in frame.itertuples(index=False)]
    return "\n".join("| " + " | ".join(str(v) for v in r) + " |" for r in rows)


def _k(value) -> str:
    if value is None:
        return "-"
    return f"{value // 1024}K" if isinstance(value, numbers.Integral) else str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument(
        "--gpu-gib", type=float, default=79.18, help="an H100 80GB's memory as torch reports it"
    )
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--step", type=int, default=1024)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--backends", default="deepspeed,fsdp,torch_zero")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    started = time.time()
    experiment = load_experiment(Path(args.experiment))
    searches = longest(
        experiment,
        gpu=args.gpu,
        gpu_gib=args.gpu_gib,
        lengths=[int(x) for x in args.lengths.split(",")],
        step=args.step,
        workers=[int(x) for x in args.workers.split(",")],
        backends=args.backends.split(","),
        log=lambda text: print(f"[{time.time() - started:6.0f} s] {text}", flush=True),
    )
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(  # every length estimated, as estimate's fit rule judged it
        {
            "backend": s.backend,
            "stage": s.stage,
            "gpus": s.workers,
            "checkpointing": s.checkpointing,
            "seq_len": n,
            "needed_gib": round(s.needed[n], 3),
            "fits": s.verdict[n],
        }
        for s in searches
        for n in sorted(s.verdict)
    ).to_csv(output / "lengths.csv", index=False)
    frame = table(searches, largest_layer(experiment))
    seconds = time.time() - started
    frame.to_csv(output / "finetune_question.csv", index=False)
    text = (
        f"Longest seq_len (multiple of {args.step}) at micro-batch 1 that `estimate` says fits "
        f"{args.gpu} ({args.gpu_gib:g} GiB), activation checkpointing off / on "
        f"({experiment.name}; {seconds:.0f} s, {int(frame.lengths_estimated.sum())} point-lengths):\n\n"
        f"{compact(frame)}\n\n{states(frame)}\n\nEvery point:\n\n"
        f"{markdown(frame.drop(columns=['backend', 'stage']))}\n"
    )
    (output / "finetune_question.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
