"""bench/population_gpu.py's driver: a fresh process per family (or per op-by-op comparison), `jobs` at a
time on the one device, each admitted to the GPU once its predicted peak fits beside those training, each
with its own time limit; a record per job, and a line on the console for each.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Optional

from common import free_port, machine, versions

MARGIN_GIB = 1.5
"""Beside each family's predicted peak when packing the GPU: its CUDA context and the allocator's
reserved-over-allocated margin."""


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
    blind = record.get("set") == "held-out"  # its residuals are read once, at the end (issue 65)
    parts = []
    for name, f in forms.items():
        ratio = f.get("measured_over_predicted")
        figure = f"{ratio:.3f}" if isinstance(ratio, float) else f"{f.get('measured_peak_gib') or 0:.2f} GiB"
        parts.append(f"{name} {f.get('status')}" + ("" if blind else f" {figure}"))
    tail = f" ({record['error'][:200]})" if record.get("error") else ""
    return (
        f"{record['family']} [{record['set']}] mb {record.get('sizes', {}).get('micro_batch')}: "
        + (", ".join(parts) or record["status"])
        + tail
    )
