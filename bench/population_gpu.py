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
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Optional

from common import ROOT, free_port, machine, versions
from population_split import family_id, load_split

POPULATION = ROOT / "bench" / "results" / "conformance-cpu-2core" / "population.json"
RECORDS, OPS = "population.jsonl", "ops.jsonl"
OFF = 0.05
"""A row off by more than this (|measured / predicted - 1|) gets an op-by-op comparison with --ops."""
SMOKE = ["timm:resnet", "hf:gpt2", "hf:bert"]
MARGIN_GIB = 1.5
"""Beside each family's predicted peak when packing the GPU: its CUDA context and the allocator's
reserved-over-allocated margin."""


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


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gpu_memory_gib() -> float:
    """The GPU's memory from nvidia-smi (the driver holds no CUDA context of its own)."""
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        return float(subprocess.run(query, capture_output=True, text=True).stdout.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        return 80.0


class Child:
    """One family's (or one op-by-op comparison's) process, and what it said."""

    def __init__(self, job: dict):
        self.job = job
        self.where, self.forms, self.need, self.partial = "starting", {}, None, {}
        self.admitted = self.beside = False
        self.started = time.monotonic()
        self.waited = 0.0  # seconds waiting for room on the GPU: not counted against its time limit
        self._waiting_since: Optional[float] = None
        context = mp.get_context("spawn")  # a fresh interpreter: its own CUDA context and allocator
        mine, theirs = context.Pipe()
        from population_child import main

        self.process = context.Process(target=main, args=(theirs, job), daemon=True)
        self.process.start()
        self.connection = mine

    def worked(self) -> float:
        waiting = time.monotonic() - self._waiting_since if self._waiting_since is not None else 0.0
        return time.monotonic() - self.started - self.waited - waiting

    def receive(self) -> Optional[dict]:
        """The record once the child is done; None while it goes on."""
        try:
            kind, value = self.connection.recv()
        except (EOFError, OSError):
            self.process.join(5)
            return self._end("child died", f"the child died (exit code {self.process.exitcode}) during "
                                           f"{self.where}")  # fmt: skip
        if kind == "phase":
            self.where = value
        elif kind == "sized":
            self.partial = value
        elif kind == "form":
            self.forms[value.pop("name")] = value
        elif kind == "plan":
            self.need, self.where = value["need_gib"], "waiting for room on the GPU"
            self._waiting_since = time.monotonic()
        elif kind == "done":
            self.process.join(30)
            self.kill()
            return {**self.partial, **value, "forms": {**self.forms, **value.get("forms", {})}}
        return None

    def go(self) -> None:
        self.waited += time.monotonic() - self._waiting_since
        self._waiting_since, self.admitted = None, True
        self.connection.send("go")

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()

    def _end(self, status: str, error: str) -> dict:
        self.kill()
        return {**self.partial, "status": status, "error": error, "forms": self.forms}


class Driver:
    """Families started `jobs` at a time; each waits after its sizing until the GPU has room for its
    predicted peak beside those running (or runs alone); each has `timeout_s` of its own time."""

    def __init__(self, args, command: str):
        self.args, self.command = args, command
        self.output: Path = args.output
        self.capacity = math.inf if args.device == "cpu" else args.gpu_gib - 2.0
        self.began = time.monotonic()
        self.provenance = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": command,
            "machine": machine(),
            **versions(("torch", "deepspeed", "transformers", "timm")),
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def run(self, jobs: list[dict], sink: Path, finish) -> int:
        """Run `jobs` (front first); `finish(job, record)` makes each line of `sink`. Stops starting
        jobs at the budget; what still runs at budget + time limit is stopped and not recorded."""
        queue, running, done = list(jobs), [], 0
        deadline = self.args.budget_s + self.args.timeout_s
        while queue or running:
            while queue and len(running) < self.args.jobs and self.elapsed() < self.args.budget_s:
                job = queue.pop(0)
                if job.get("folder"):  # a family run again (not recorded, or --retry) starts clean
                    shutil.rmtree(job["folder"], ignore_errors=True)
                running.append(Child({**job, "port": free_port()}))
            if not running:
                break
            ready = wait([c.connection for c in running], timeout=2)
            for child in list(running):
                record = None
                while record is None and child.connection in ready and child.connection.poll():
                    record = child.receive()
                if record is None and child.worked() > self.args.timeout_s:
                    record = child._end("timeout", f"timeout after {self.args.timeout_s:.0f} s (during "
                                                   f"{child.where})")  # fmt: skip
                if record is None:
                    continue
                running.remove(child)
                if self._alone_again(child, record):
                    queue.insert(0, {**child.job, "alone": True})
                    print(f"population: {child.job['family']}: out of memory beside others; again alone")
                    continue
                line = finish(child.job, record)
                with sink.open("a") as file:
                    file.write(json.dumps(line, default=str) + "\n")
                done += 1
                print(f"[{done} {self.elapsed():.0f} s] {_line(line)}", flush=True)
            self._admit(running)
            if self.elapsed() > deadline:
                for child in running:
                    child.kill()
                    print(f"population: {child.job['family']}: stopped at the part's end, not recorded")
                break
        left = [j["family"] for j in queue]
        if left:
            print(f"population: budget spent; {len(left)} left for the next part (first: {left[0]})")
        return done

    def _admit(self, running: list[Child]) -> None:
        """Let waiting children train, oldest first, while their predicted peaks (plus a margin each)
        fit in the GPU's memory; one whose peak is unknown, or asked to, runs alone."""
        admitted = [c for c in running if c.admitted]
        used = sum(self._need(c) for c in admitted)
        for child in running:
            if child.admitted or child._waiting_since is None:
                continue
            need = self._need(child)
            if admitted and used + need > self.capacity:
                break  # in order: a large family is not overtaken for ever by small ones
            child.beside = bool(admitted)
            for other in admitted:
                other.beside = True
            child.go()
            admitted.append(child)
            used += need

    def _need(self, child: Child) -> float:
        if child.job.get("alone") or child.need is None:
            return self.capacity
        return child.need + MARGIN_GIB

    def _alone_again(self, child: Child, record: dict) -> bool:
        oom = any(f.get("status") == "oom" for f in record.get("forms", {}).values())
        return oom and child.beside and not child.job.get("alone") and self.args.device == "gpu"


def _line(record: dict) -> str:
    if "form" in record:  # an op-by-op comparison
        ops = record.get("ops") or {}
        rise = lambda key: f"{(ops.get(key) or {}).get('rise_bytes', 0) / 2**30:.3f}"  # noqa: E731
        return (f"{record['family']} {record['form']}: op by op {record['status']}: meta {rise('meta')}, "
                f"CUDA ops {rise('cuda')}, allocator {ops.get('allocator_rise_bytes', 0) / 2**30:.3f} GiB"
                + (f" ({record['error'][:200]})" if record.get("error") else ""))  # fmt: skip
    forms = record.get("forms") or {}
    parts = []
    for name, f in forms.items():
        ratio = f.get("measured_over_predicted")
        figure = f"{ratio:.3f}" if isinstance(ratio, float) else f"{f.get('measured_peak_gib') or 0:.2f} GiB"
        parts.append(f"{name} {f.get('status')} {figure}")
    tail = f" ({record['error'][:200]})" if record.get("error") else ""
    return (
        f"{record['family']} [{record['set']}] mb {record.get('sizes', {}).get('micro_batch')}: "
        + (", ".join(parts) or record["status"])
        + tail
    )


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
    """An op-by-op job for each form off by more than OFF without a record yet."""
    jobs = []
    for record in records:
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
    records = read_jsonl(sink)
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
        compared = {(r["family"], r["form"]) for r in read_jsonl(args.output / OPS)}
        jobs = ops_jobs(args, read_jsonl(sink), compared)
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
