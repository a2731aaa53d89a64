"""Issue 65's GPU population: every family of bench/population_split.json (98 timm families, 271
Transformers types) trained on one GPU at a size users train, in four forms, each form's measured peak
beside ray_zero's traced prediction of it, in resumable parts.

Per family, one fresh process (population_child.py): the family sized and its micro-batch chosen from its
traced step on the CPU (population_cases.py), each form's step traced as a sweep traces it, then (once
the GPU has room for its predicted peak beside the other families running) the forms trained by a
sweep's rank code, one rank: DeepSpeed ZeRO-1 bf16; DeepSpeed ZeRO-3 fp16, checkpointed; FSDP2 (stage 3)
bf16; DDP + ZeRO-1 bf16, checkpointed. A run folder per family as a sweep writes one (OUTPUT/<family>/:
`python -m ray_zero report` reads it) and one line per family in OUTPUT/population.jsonl; a rerun skips
the families there. Several families at once (--jobs): each process's allocator peak is its own.

    python bench/population_gpu.py --output DIR [--set tuning|held-out|all] [--budget-s 500] [--ops]
    python bench/population_gpu.py --output DIR --only hf:gpt2 timm:resnet       # a few families
    python bench/population_gpu.py --output /tmp/p --cpu-smoke                   # CPU, tiny, 3 families
    python bench/population_gpu.py --table DIR [DIR ...]                          # the tables, anywhere

--ops: a second pass over the forms off by more than 5 %: each compared operator by operator with the
same step's CUDA tensors (bench/trace_gpu.run_case), in OUTPUT/ops.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from common import ROOT
from population_driver import Driver
from population_split import family_id, load_split
from population_table import read_records

POPULATION = ROOT / "bench" / "results" / "conformance-cpu-2core" / "population.json"
RECORDS, OPS = "population.jsonl", "ops.jsonl"
OFF = 0.05
"""A row off by more than this (|measured / predicted - 1|) gets an op-by-op comparison with --ops."""
SMOKE = ["timm:resnet", "hf:gpt2", "hf:bert"]


def slug(family: str) -> str:
    return family.replace(":", "_").replace("/", "_")


def ordered_families(which: str, only: Optional[list[str]]) -> list[tuple[str, str]]:
    """(family, set) in the order parts run them: the tuning families first, then the held-out third
    (measured at the end), each in the split file's (random) order."""
    split = load_split()
    order = [(f, "tuning") for f in split["tuning"]] + [(f, "held-out") for f in split["held_out"]]
    if which != "all":
        order = [(f, s) for f, s in order if s == which]
    if only:
        known = dict(order)
        missing = [f for f in only if f not in known]
        if missing:
            raise SystemExit(f"not in the split's {which} families: {', '.join(missing)}")
        order = [(f, known[f]) for f in only]
    return order


def gpu_memory_gib() -> float:
    """The GPU's memory from nvidia-smi (the driver holds no CUDA context of its own)."""
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        return float(subprocess.run(query, capture_output=True, text=True).stdout.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        return 80.0


def family_jobs(args, command: str, done: set[str]) -> list[dict]:
    cases = {family_id(c): c for c in json.loads(POPULATION.read_text())}
    jobs = []
    for family, which in ordered_families(args.set, args.only):
        if family in done:
            continue
        jobs.append({
            "kind": "family", "family": family, "set": which, "slug": slug(family), "case": cases[family],
            "output": str(args.output), "folder": str(args.output / slug(family)), "device": args.device,
            "target_gib": args.target_gib, "params_limit": args.params_limit, "seq_len": args.seq_len,
            "max_params": args.max_params, "gpu_gib": args.gpu_gib,
            "command": command,
            "jobs": args.jobs, "threads": max(1, (os.cpu_count() or 1) // args.jobs),
        })  # fmt: skip
    return jobs


def ops_jobs(args, records: list[dict], done: set[tuple[str, str]]) -> list[dict]:
    """An op-by-op job for each tuning form off by more than OFF without a record yet."""
    jobs = []
    for record in records:
        if record.get("set") != "tuning":  # the held-out third's misses are not studied (issue 65)
            continue
        case = record.get("case") or {}
        config = dict(record.get("config") or {})
        if record.get("source") == "timm" and case.get("num_classes"):
            config["num_classes"] = case["num_classes"]  # run_case's ModelSource takes no num_classes
        for name, form in (record.get("forms") or {}).items():
            ratio = form.get("measured_over_predicted")
            off = isinstance(ratio, (int, float)) and abs(ratio - 1) > OFF
            if not off or (record["family"], name) in done:
                continue
            jobs.append({
                "kind": "ops", "family": record["family"], "set": record["set"],
                "slug": slug(record["family"]), "output": str(args.output), "model": record["model"],
                "config": config,
                "seq_len": (record.get("sizes") or {}).get("seq_len"), "form": {"name": name, **form},
                "threads": max(1, (os.cpu_count() or 1) // args.jobs),
            })  # fmt: skip
    return jobs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, help="population.jsonl, ops.jsonl, a run folder per family")
    parser.add_argument("--set", default="all", choices=["tuning", "held-out", "all"])
    parser.add_argument("--only", nargs="+", metavar="FAMILY", help="these families (timm:MODULE, hf:TYPE)")
    parser.add_argument("--jobs", type=int, default=4, help="families at once on the one device")
    parser.add_argument("--timeout-s", type=float, help="each family's own time limit (150; CPU smoke 600)")
    parser.add_argument("--budget-s", type=float, default=500, help="stop starting families after this long")
    parser.add_argument("--target-gib", type=float, default=6.0, help="the traced activation rise to size to")
    parser.add_argument("--params-limit", type=float, default=1.5e9, help="cut a default's layers above it")
    parser.add_argument("--max-params", type=float, default=5e9, help="a larger family is recorded, not run")
    parser.add_argument("--seq-len", type=int, help="token models' seq_len (default: 1024 or their maximum)")
    parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--gpu-gib", type=float, help="the GPU's memory (default: nvidia-smi's)")
    parser.add_argument("--retry", nargs="+", default=[], metavar="STATUS", help="run these records again")
    parser.add_argument("--ops", action="store_true", help="then compare the rows off by > 5 %% op by op")
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny sizes, 3 families, one at a time")
    parser.add_argument("--table", type=Path, nargs="+", metavar="DIR", help="print the tables of these runs")
    parser.add_argument(
        "--predicted", action="store_true", help="--table: the predictions population_predict.py made again"
    )
    args = parser.parse_args(argv)
    if args.table:
        from population_table import tables

        print(tables(args.table, args.predicted))
        return 0
    if args.output is None:
        parser.error("--output is needed (or --table)")
    if args.cpu_smoke:
        args.device, args.target_gib, args.params_limit, args.jobs = "cpu", 0.05, 6e7, 1
        args.seq_len = args.seq_len or 128
        args.timeout_s = args.timeout_s or 600  # a shared 2-core machine: minutes where a GPU takes seconds
        args.only = args.only or SMOKE
    args.timeout_s = args.timeout_s or 150
    args.params_limit = int(args.params_limit)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the children are daemons: they go too
    args.output.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "bench/population_gpu.py", *(sys.argv[1:] if argv is None else argv)])
    if args.device == "gpu":
        args.gpu_gib = args.gpu_gib or gpu_memory_gib()
    driver = Driver(args, command)

    sink = args.output / RECORDS
    records = read_records(sink)
    done = {r["family"] for r in records if r["status"] not in args.retry}
    jobs = family_jobs(args, command, done)
    print(f"population: {len(jobs)} families to run ({len(done)} done), {args.jobs} at a time, "
          f"{driver.capacity:.0f} GiB to pack", flush=True)  # fmt: skip

    def finish(job: dict, record: dict) -> dict:
        case = job["case"]
        return {
            "family": job["family"], "set": job["set"], "source": case["source"], "task": case["task"],
            "case": {k: case.get(k) for k in ("id", "model", "num_classes", "family_size")},
            **record, "seconds": record.get("child_s"), "ran_alone": bool(job.get("alone")),
            "provenance": driver.provenance,
        }  # fmt: skip

    driver.run(jobs, sink, finish)
    if args.ops and args.device == "gpu" and driver.elapsed() < args.budget_s:
        compared = {(r["family"], r["form"]) for r in read_records(args.output / OPS)}
        jobs = ops_jobs(args, read_records(sink), compared)
        print(f"population: {len(jobs)} forms off by more than {OFF:.0%} to compare op by op", flush=True)

        def finish_ops(job: dict, record: dict) -> dict:
            return {"family": job["family"], "set": job["set"], "form": job["form"]["name"], **record,
                    "provenance": driver.provenance}  # fmt: skip

        driver.run(jobs, args.output / OPS, finish_ops)
    elif args.ops and args.device != "gpu":
        print("population: --ops needs a GPU (trace_gpu compares with CUDA tensors); skipped")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
