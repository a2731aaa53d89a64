"""Issue 66's GPU tables: LoRA and frozen layers on every engine, and a seq_len grid, measured on one GPU
beside ray_zero's traced prediction, for a decoder (a 1.1 B Llama shape), an encoder (BERT-large's shape)
and a vision model (ViT-B/16).

Per family, one fresh process (bench/population_child.py's protocol and its `_train_forms`, run by
bench/population_driver.py, several families at once, no Ray): the family's micro-batch chosen from its
traced step on the CPU (population_cases.choose_micro_batch, LoRA's step), every form's step traced as a
sweep traces it, then the forms trained by a sweep's rank code (`ray_zero.train.worker.train`), one rank,
bf16, no checkpointing:

- LoRA r 16 (alpha 32) on the attention projections, and, apart, the embeddings and the first half of the
  blocks frozen by fnmatch pattern; each on DeepSpeed ZeRO-1 and ZeRO-3, FSDP2 (stage 3) and DDP
  (torch_zero stage 0), at the chosen micro-batch;
- for the token models, LoRA on DeepSpeed ZeRO-1 over a seq_len grid: 1,024 to 8,192 tokens at
  micro-batch 1 for the decoder, 64 to 512 at the chosen micro-batch for the encoder.

Each finetune kind is one experiment, so one run folder as a sweep writes it: OUTPUT/<family>/lora and
OUTPUT/<family>/frozen (`python -m ray_zero report` reads either); one line per family in
OUTPUT/finetune.jsonl; a rerun skips the families there.

    python bench/finetune_gpu.py --output DIR [--only llama bert vit] [--jobs 3]   # the GPU run
    python bench/finetune_gpu.py --output /tmp/f --tiny                # CPU, tiny shapes, gloo, end to end
    python bench/finetune_gpu.py --output /tmp/p --plan                # CPU: the GPU's predictions, no run
    python bench/finetune_gpu.py --table DIR [DIR ...]                 # the tables (finetune_table.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
ENGINES = {
    "ds1": ("deepspeed", 1),
    "ds3": ("deepspeed", 3),
    "fsdp3": ("fsdp", 3),
    "ddp": ("torch_zero", 0),
}
"""(backend, stage) of each engine's row; DDP last, as in population_child.FORMS (it may leave bytes
allocated after its rank returns). The seq_len grid runs on ds1, before ds3."""
SEQ_ENGINE = "ds1"
PRECISION = "bf16"
LORA = {"r": 16, "lora_alpha": 32}
STEPS, WARMUP = 4, 2
"""Only memory matters here: the peak comes with the first optimizer steps (population_child.py)."""
RECORDS = "finetune.jsonl"


@dataclass(frozen=True)
class Family:
    """One family: its model at the size users train and at --tiny's, what LoRA adapts and what freezes."""

    model: str
    config: dict
    tiny: dict
    """model_config for --tiny (a few layers, small widths: a CPU step in a second or two)."""
    layers_key: str
    """The model_config key of its block count: the first half of the blocks freezes."""
    lora_targets: tuple[str, ...]
    """The attention projections, in peft's rule (a name or its last dotted parts)."""
    frozen_embedding: tuple[str, ...]
    block: str
    """A block's parameter pattern, {} its index."""
    seq_len: int | None = None
    seq_grid: tuple[int, ...] = ()
    tiny_seq_len: int | None = None
    tiny_seq_grid: tuple[int, ...] = ()
    what: str = ""
    grid_micro: int | None = None
    """The seq_len grid's micro-batch; None: the family's chosen one (an encoder's 512 tokens at one sample
    would be model states only)."""


FAMILIES = {
    "llama": Family(
        "hf:llama",
        # TinyLlama's 1.1 B shape (the README's zoo), its positions raised to the grid's 8,192
        {
            "hidden_size": 2048,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "intermediate_size": 5632,
            "vocab_size": 32000,
            "max_position_embeddings": 8192,
        },
        {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 2000,
            "max_position_embeddings": 256,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        "num_hidden_layers",
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        ("model.embed_tokens.*",),
        "model.layers.{}.*",
        2048,
        (1024, 2048, 4096, 8192),
        64,
        (32, 64, 128, 256),
        "decoder: Llama shape, 1.1 B",
        1,
    ),  # fmt: skip
    "bert": Family(
        "hf:bert",
        # BERT-large's shape (masked LM, 335 M), seq_len up to its 512 positions
        {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
        {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 2000,
            "max_position_embeddings": 128,
        },
        "num_hidden_layers",
        ("query", "key", "value", "attention.output.dense"),
        ("bert.embeddings.*",),
        "bert.encoder.layer.{}.*",
        512,
        (64, 128, 256, 512),
        64,
        (16, 32, 64, 128),
        "encoder: BERT-large shape, 335 M",
    ),  # fmt: skip
    "vit": Family(
        "timm:vit_base_patch16_224",
        {"depth": 12},
        {"depth": 4, "embed_dim": 64, "num_heads": 4, "img_size": 32},
        "depth",
        # qkv is fused; "proj" alone would also match the patch embedding's Conv2d
        ("attn.qkv", "attn.proj"),
        ("cls_token", "pos_embed", "patch_embed.*"),
        "blocks.{}.*",
        what="vision: ViT-B/16, 86.6 M",
    ),  # fmt: skip
}


def slug(family: str) -> str:
    return family


def _config(family: Family, tiny: bool) -> dict:
    return dict(family.tiny if tiny else family.config)


def freeze_patterns(family: Family, tiny: bool) -> list[str]:
    """The embeddings and the first half of the blocks, by fnmatch pattern (one per block)."""
    layers = _config(family, tiny)[family.layers_key]
    return [*family.frozen_embedding, *(family.block.format(i) for i in range(layers // 2))]


def experiment_dicts(job: dict, micro: int, grid_micro: int = 1) -> dict[str, dict]:
    """{lora | frozen: the experiment as a file would hold it}: one run folder each."""
    family, tiny = FAMILIES[job["family"]], job["tiny"]
    seq_len = seq_len_of(job)
    grid_seq = list(family.tiny_seq_grid if tiny else family.seq_grid)
    base = {
        "model": family.model,
        "model_config": _config(family, tiny),
        "device": job["device"],
        "precision": PRECISION,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "timing_min_s": 0,
        "timing_spread": None,
        "calibrate": False,
    }
    grid = {
        "backend": sorted({b for b, _ in ENGINES.values()}),
        "stage": sorted({s for _, s in ENGINES.values()}),
        "micro_batch_size": [micro],
    }
    lora = {"lora": {**LORA, "target_modules": list(family.lora_targets)}}
    lora_grid = dict(grid)
    if grid_seq:  # the seq_len axis: the engines' rows at the family's seq_len, the grid at its micro-batch
        lora_grid.update(seq_len=sorted({*grid_seq, seq_len}), micro_batch_size=sorted({grid_micro, micro}))
    question = "{}: {} on DeepSpeed 1 and 3, FSDP2 and DDP, traced peak against measured (issue 66)"
    adapters = f"LoRA r {LORA['r']} on {', '.join(family.lora_targets)}"
    frozen = "the embeddings and the first half of the blocks frozen"
    return {
        "lora": {
            "name": f"{job['family']}_lora",
            "question": question.format(family.what, adapters)
            + (f"; a seq_len grid {grid_seq}, micro-batch {grid_micro}, {SEQ_ENGINE}" if grid_seq else ""),
            **base, "finetune": lora, "grid": lora_grid,
            **({} if grid_seq else {"seq_len": seq_len}),
        },
        "frozen": {
            "name": f"{job['family']}_frozen",
            "question": question.format(family.what, frozen),
            **base, "seq_len": seq_len, "finetune": {"freeze": freeze_patterns(family, tiny)}, "grid": grid,
        },
    }  # fmt: skip


def seq_len_of(job: dict) -> int | None:
    family = FAMILIES[job["family"]]
    return family.tiny_seq_len if job["tiny"] else family.seq_len


def points_of(kind: str, experiment, micro: int, seq_len: int | None, grid_micro: int) -> dict:
    """{row name: Point}: the four engines at `micro` (at the family's seq_len), and for LoRA on a seq_len
    axis the grid at `grid_micro` on SEQ_ENGINE."""
    from ray_zero.config import Point

    axis = experiment.grid.seq_len
    points = {}
    for engine, (backend, stage) in ENGINES.items():
        points[f"{kind} {engine}"] = Point(backend, stage, micro, 1, False, seq_len=seq_len if axis else None)
        if engine == SEQ_ENGINE and axis:
            for length in sorted(axis):
                point = Point(backend, stage, grid_micro, 1, False, seq_len=length)
                if point not in points.values():  # the engine's own row may be one of them
                    points[f"{kind} {engine} mb{grid_micro} s{length}"] = point
    return points


def run_family(job: dict, say, connection, record: dict) -> dict:
    """The child's work for one family (population_child.main calls it: job["entry"])."""
    import torch
    import yaml
    from population_cases import choose_micro_batch
    from population_child import _provenance, _train_forms, plan_forms

    from ray_zero.config import Point, TrialSpec
    from ray_zero.experiment_file import validate_experiment
    from ray_zero.models.describe import describe_lengths
    from ray_zero.rows import trial_row
    from ray_zero.store import EXPERIMENT_FILE, atomic_write
    from ray_zero.train.grid_trace import trace_grid, trace_key

    on_gpu = job["device"] == "gpu"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    family = FAMILIES[job["family"]]
    say("phase", "sizing")
    started = time.monotonic()
    seq_len = seq_len_of(job)
    lora = validate_experiment(experiment_dicts(job, 1)["lora"], source=job["family"])
    chosen = job["micro_batch"] and {"micro_batch": job["micro_batch"], "micro_batch_why": "--micro-batch"}
    at = Point("deepspeed", 1, 1, 1, False, seq_len=seq_len if lora.grid.seq_len else None)
    chosen = chosen or choose_micro_batch(lora.model_source(at), job["target_gib"] * GIB)  # LoRA's step
    micro = chosen["micro_batch"]
    grid_micro = family.grid_micro or micro
    record.update(
        model=family.model,
        config=_config(family, job["tiny"]),
        sizes={**chosen, "seq_len": seq_len, "grid_micro_batch": grid_micro},
    )
    say("sized", record)
    say("phase", "tracing")
    runs = {}  # kind: (experiment, {name: TrialSpec})
    for kind, raw in experiment_dicts(job, micro, grid_micro).items():
        experiment = validate_experiment(raw, source=f"{job['family']} {kind}")
        model = describe_lengths(experiment.model_source(), experiment.grid.seq_len)
        points = points_of(kind, experiment, micro, seq_len, grid_micro)
        traced = trace_grid(experiment.model_source(), points.values(), PRECISION)
        folder = str(Path(job["folder"]) / kind)
        specs = {}
        for name, point in points.items():
            outcome = traced.get(trace_key(point.backend, PRECISION, False, point.seq_len))
            # Traced on the CPU too (the same code path), used on the GPU only: a CPU row predicts no peak.
            specs[name] = TrialSpec(experiment, point, PRECISION, on_gpu or job["plan"], model, folder,
                                    activations=outcome if on_gpu or job["plan"] else None)  # fmt: skip
        runs[kind] = (experiment, model, specs)
        record.setdefault("params", {})[kind] = {
            "params": model.params,
            "trainable_params": model.trainable_params,
        }
    predicted = {n: trial_row(s) for *_, specs in runs.values() for n, s in specs.items()}
    record["predicted_gib"] = {n: r.get("predicted_peak_gib") for n, r in predicted.items()}
    record["prepare_s"] = round(time.monotonic() - started, 1)
    skipped, need = plan_forms(predicted, job["gpu_gib"], on_gpu)
    if job["plan"]:  # no "plan" message: the driver has nothing to admit
        return {**record, "status": "planned", "error": None}
    say("plan", {"need_gib": need, "forms": record["predicted_gib"]})
    if connection.recv() != "go":
        return {**record, "status": "not run", "error": "the driver did not say go"}
    provenances, specs = {}, {}
    for kind, (experiment, model, mine) in runs.items():
        folder = Path(job["folder"]) / kind  # written after "go": the device's name opens a CUDA context
        folder.mkdir(parents=True, exist_ok=True)
        provenance = _provenance(job, experiment, device)
        provenance.update(
            precision=PRECISION, ray="not used (bench/finetune_gpu.py: one rank in one process per family)",
            cluster="one process, one rank; the other families' processes beside it on the device",
        )  # fmt: skip
        atomic_write(folder / EXPERIMENT_FILE, yaml.safe_dump(
            {"experiment": experiment.model_dump(mode="json"), "model": dataclasses.asdict(model),
             "provenance": {**provenance, "sizes": record["sizes"]}}, sort_keys=False))  # fmt: skip
        provenances[str(folder)] = provenance
        specs.update(mine)
    record.update(gpu=provenance["driver_gpus"], gpu_memory_gib=provenance["gpu_memory_gib"])
    outcome = _train_forms(job, specs, skipped, device, provenances, say)
    return {**record, **outcome}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, help="finetune.jsonl and a run folder per family and kind")
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), help="these families (default all)")
    parser.add_argument("--jobs", type=int, default=3, help="families at once on the one device")
    parser.add_argument("--timeout-s", type=float, help="each family's own time limit (420; --tiny 900)")
    parser.add_argument("--budget-s", type=float, default=120, help="start no family after this long")
    parser.add_argument("--target-gib", type=float, default=10.0, help="LoRA's traced activation rise")
    parser.add_argument("--micro-batch", type=int, help="every family's micro-batch (default: chosen)")
    parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--gpu-gib", type=float, help="the GPU's memory (nvidia-smi's; --plan 79.18)")
    parser.add_argument("--retry", nargs="+", default=[], metavar="STATUS", help="run these records again")
    parser.add_argument("--tiny", action="store_true", help="CPU, gloo, every family a few small layers")
    parser.add_argument("--plan", action="store_true", help="CPU: the GPU's predictions, no run")
    parser.add_argument("--table", type=Path, nargs="+", metavar="DIR", help="print the tables of these runs")
    args = parser.parse_args(argv)
    if args.table:
        from finetune_table import tables

        print(tables(args.table))
        return 0
    if args.output is None:
        parser.error("--output is needed (or --table)")
    from common import versions
    from population_driver import Driver
    from population_gpu import gpu_memory_gib
    from population_table import read_records

    if args.tiny:
        args.device, args.target_gib = "cpu", 0.02
        args.timeout_s = args.timeout_s or 900  # a shared 2-core machine
    if args.plan:
        args.device, args.gpu_gib = "cpu", args.gpu_gib or 79.18
    args.timeout_s = args.timeout_s or 420
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the children are daemons: they go too
    args.output.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "bench/finetune_gpu.py", *(sys.argv[1:] if argv is None else argv)])
    if args.device == "gpu":
        args.gpu_gib = args.gpu_gib or gpu_memory_gib()
    driver = Driver(args, command)
    sink = args.output / RECORDS
    done = {r["family"] for r in read_records(sink) if r["status"] not in args.retry}
    jobs = [
        {"kind": "finetune", "entry": "finetune_gpu:run_family", "family": name, "set": "finetune",
         "slug": slug(name), "output": str(args.output), "folder": str(args.output / slug(name)),
         "device": args.device, "tiny": args.tiny, "plan": args.plan, "target_gib": args.target_gib,
         "micro_batch": args.micro_batch, "gpu_gib": args.gpu_gib, "command": command, "jobs": args.jobs,
         "threads": max(1, (os.cpu_count() or 1) // args.jobs)}
        for name in (args.only or FAMILIES) if name not in done
    ]  # fmt: skip
    print(f"finetune: {len(jobs)} families to run ({len(done)} done), {args.jobs} at a time", flush=True)

    driver.provenance.update(versions(("peft",)))

    def finish(job: dict, record: dict) -> dict:
        return {"family": job["family"], "set": "finetune", "tiny": job["tiny"], **record,
                "seconds": record.get("child_s"), "provenance": driver.provenance}  # fmt: skip

    driver.run(jobs, sink, finish)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
