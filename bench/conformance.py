"""Conformance: does ray_zero handle every model family a user may bring? (issue 42)

The population: the smallest model (by parameters, counted on the meta device) of every timm architecture
family (`timm.list_modules()`), and every Transformers model type whose task ray_zero trains (the four
auto mappings ray_zero/models/hf_source.py picks the task from), shrunk through its configuration's size
keys. Each model, in a worker process under torch.distributed (gloo, world size 1, as a sweep's rank):

    describe  ray_zero.models.describe.describe_model on the meta device
    train     3 steps, bf16, micro-batch 2, on DeepSpeed ZeRO-1 and on FSDP2 (stage 3), with
              ray_zero.train.worker.train: the loss finite, and each kind of model-state bytes the memory
              model's (to the byte, Adam's step counters aside: tests/test_zoo.py's rule)
    calibrate the first engine that trains, at its smallest stage, at sizes of 4, 8 and 12 MiB of
              activations (calibration_probes); the fit's verdict

One JSON line per model in OUTPUT/results.jsonl: a rerun skips the models there. Each model has a time
limit (its worker is killed at it: "timeout after N s"). The table goes to docs/conformance.md. This file
is the driver (workers, time limits, records); one model's checks: conformance_check.py; the models:
conformance_population.py and hf_shrink.py; the table: conformance_table.py.

    nice -n 19 python bench/conformance.py --output /tmp/conformance             # everything, resumes
    nice -n 19 python bench/conformance.py --output /tmp/c --only timm:resnet18 hf:gpt2   # a few
    python bench/conformance.py --output /tmp/conformance --table-only           # the table again
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Optional

from common import ROOT, free_port, machine, versions, write_whole
from conformance_check import worker_main
from conformance_population import build_population, hf_case_that_describes
from conformance_table import (
    PACKAGES,
    POPULATION_FILE,
    RESULTS_FILE,
    engine_result,
    read_records,
    summary_line,
    write_table,
)

sys.path.append(str(ROOT))  # appended: a PYTHONPATH snapshot of ray_zero, if given, comes first

LARGE_PARAMS = 50_000_000
"""A model this large runs alone (its engines and calibration take GBs beside the other engineer's work)."""
TABLE = ROOT / "docs" / "conformance.md"
READY_TIMEOUT_S = 180
"""A worker's start: spawn, imports (torch, DeepSpeed, Transformers, timm), the process group."""
MODELS_PER_WORKER = 25
"""A worker is started afresh after this many models (and after any failure): what one model leaves in
the process (allocator fragmentation, a library's global state) does not reach many others."""


def load_population(output: Path) -> list[dict[str, Any]]:
    """The population, counted once (timm's 1,300-odd models on the meta device take minutes) and kept in
    OUTPUT/population.json; counted in a child process, so this long-lived driver holds no models."""
    path = output / POPULATION_FILE
    if not path.is_file():
        with mp.get_context("spawn").Pool(1) as pool:
            cases = pool.apply(build_population)
        write_whole(path, json.dumps(cases, indent=1))
    return json.loads(path.read_text())


class Worker:
    """One worker process and the model it is checking."""

    def __init__(self, index: int, output: Path):
        self.index, self.output = index, output
        self.process = self.connection = None
        self.case: Optional[dict] = None
        self.started = 0.0
        self.where, self.partial = "starting", {}
        self.checked = 0

    def start(self) -> None:
        context = mp.get_context("spawn")
        mine, theirs = context.Pipe()
        log = self.output / f"worker{self.index}.log"
        self.process = context.Process(target=worker_main, args=(free_port(), str(log), theirs), daemon=True)
        self.process.start()
        self.connection, self.checked = mine, 0
        if not mine.poll(READY_TIMEOUT_S) or mine.recv()[0] != "ready":
            self.stop()
            raise RuntimeError(f"worker {self.index} did not start in {READY_TIMEOUT_S} s (see {log})")

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            self.connection.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join()
        self.process = self.connection = None

    def send(self, case: dict) -> None:
        if self.process is None or not self.process.is_alive() or self.checked >= MODELS_PER_WORKER:
            self.stop()
            self.start()
        self.case, self.started, self.where, self.partial = case, time.monotonic(), "sent", {}
        self.connection.send(case)

    def receive(self) -> Optional[dict]:
        """The model's record once it is done (None while it goes on); a dead worker's record says so."""
        try:
            kind, value = self.connection.recv()
        except (EOFError, OSError):
            code = self.process.exitcode if self.process is not None else None
            self.kill()
            return self._end("worker died", f"the worker process died (exit code {code}) during {self.where}")
        if kind == "progress":
            self.where, self.partial = value["where"], value["record"]
            return None
        self.checked += 1
        if value.get("status") != "checked" or _failures(value):
            self.stop()  # a failure may leave state behind (a half-built engine): the next model starts clean
        return self._finish(value)

    def timed_out(self, limit_s: float) -> Optional[dict]:
        if self.case is None or time.monotonic() - self.started < limit_s:
            return None
        self.kill()
        return self._end("timeout", f"timeout after {limit_s:.0f} s (during {self.where})")

    def _end(self, status: str, error: str) -> dict:
        return self._finish({**self.partial, "id": self.case["id"], "status": status, "error": error})

    def _finish(self, record: dict) -> dict:
        record = {
            **{
                k: self.case.get(k)
                for k in ("source", "family", "task", "model", "model_config", "family_size", "shrink")
            },
            **record,
            "wall_s": round(time.monotonic() - self.started, 1),
            "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        self.case = None
        return record


def _failures(record: dict) -> list[str]:
    return [b for b, e in record.get("engines", {}).items() if engine_result(e)[0] != "pass"]


def _large(case: dict) -> bool:
    return (case.get("params_counted") or 0) > LARGE_PARAMS


def _next_case(queue: list[dict], running: list[dict]) -> Optional[dict]:
    """The next model to start beside `running`: none beside a large one, a large one only alone (so the
    large ones run last, one at a time)."""
    if any(map(_large, running)):
        return None
    return next((case for case in queue if not (running and _large(case))), None)


def run(cases: list[dict], output: Path, jobs: int, limit_s: float, max_params: int) -> None:
    """Check every case, `jobs` at a time, appending each record to OUTPUT/results.jsonl as it ends."""
    results = output / RESULTS_FILE
    queue = sorted(cases, key=_large)  # the large ones last, one at a time
    workers = [Worker(i, output) for i in range(jobs)]
    total, done, began = len(queue), 0, time.monotonic()
    try:
        while queue or any(w.case for w in workers):
            for worker in workers:
                case = _next_case(queue, [w.case for w in workers if w.case is not None])
                if worker.case is None and case is not None:
                    queue.remove(case)
                    worker.send({**case, "max_params": max_params})
            busy = [w for w in workers if w.case is not None]
            ready = wait([w.connection for w in busy], timeout=5)
            for worker in busy:
                record = worker.receive() if worker.connection in ready else worker.timed_out(limit_s)
                if record is None:
                    continue
                with results.open("a") as file:
                    file.write(json.dumps(record, default=str) + "\n")
                done += 1
                elapsed = time.monotonic() - began
                print(f"[{done}/{total} {elapsed:.0f} s] {record['id']}: {summary_line(record)}", flush=True)
    finally:
        for worker in workers:
            worker.stop()



def ray_zero_source() -> str:
    """Which ray_zero the workers import (a snapshot on PYTHONPATH, or this checkout) and its commit."""
    import importlib.util
    import subprocess

    origin = Path(importlib.util.find_spec("ray_zero").origin).parent.parent
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if origin == ROOT:
        return f"this checkout ({commit} with any uncommitted changes)"
    stamp = origin / "COMMIT"  # written beside the copy when it was taken
    taken = stamp.read_text().strip() if stamp.is_file() else "an unrecorded commit"
    return f"{origin}: a copy of ray_zero/ at {taken}, on PYTHONPATH"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="results.jsonl, population.json, logs")
    parser.add_argument("--only", nargs="+", metavar="ID", help="these models (timm:NAME, hf:TYPE) only")
    parser.add_argument("--jobs", type=int, default=1, help="models checked at once, one worker each")
    parser.add_argument("--timeout-s", type=float, default=1200, help="each model's time limit")
    parser.add_argument(
        "--max-params", type=int, default=200_000_000, help="a larger model is recorded, not trained"
    )
    parser.add_argument(
        "--retry",
        nargs="+",
        default=[],
        metavar="STATUS",
        help="check again the models recorded with these statuses (timeout, 'worker died')",
    )
    parser.add_argument("--table", type=Path, help=f"default {TABLE.relative_to(ROOT)}, OUTPUT's with --only")
    parser.add_argument("--table-only", action="store_true", help="write the table from results.jsonl")
    args = parser.parse_args()
    # A SIGTERM (kill) stops the workers too, as Ctrl-C does: the models they check are not recorded.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.output.mkdir(parents=True, exist_ok=True)
    table = args.table or (args.output / "conformance.md" if args.only else TABLE)
    command = " ".join(
        ([f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else [])
        + ["nice", "-n", str(os.nice(0))] * bool(os.nice(0))
        + ["python", "bench/conformance.py", *sys.argv[1:]]
    )
    if not args.table_only:
        began = time.monotonic()
        if args.only:  # the population's case where it was counted already, else made here
            path = args.output / POPULATION_FILE
            known = {c["id"]: c for c in json.loads(path.read_text())} if path.is_file() else {}
            population = [known.get(i) or _extra_case(i) for i in args.only]
        else:
            population = load_population(args.output)
        records = read_records(args.output)
        todo = [c for c in population if c["id"] not in records or records[c["id"]]["status"] in args.retry]
        print(
            f"conformance: {len(todo)} of {len(population)} models to check, {args.jobs} at a time",
            flush=True,
        )
        run(todo, args.output, args.jobs, args.timeout_s, args.max_params)
        with (args.output / "runs.jsonl").open("a") as file:
            file.write(
                json.dumps(
                    {
                        "command": command,
                        "only": bool(args.only),
                        "checked": len(todo),
                        "wall_s": round(time.monotonic() - began, 1),
                        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                        "versions": versions(PACKAGES),
                        "machine": machine(),
                        "ray_zero": ray_zero_source(),
                    }
                )
                + "\n"
            )
    print(write_table(args.output, table), f"\nconformance: the table is in {table}", sep="\n", flush=True)
    return 0


def _extra_case(model_id: str) -> dict[str, Any]:
    """A model outside the population (--only timm:resnet18): a timm name as it is, an hf type shrunk."""
    if model_id.startswith("hf:"):
        return hf_case_that_describes(model_id[3:])
    return {
        "id": model_id,
        "source": "timm",
        "family": "(not the family's smallest)",
        "task": "image-classification",
        "model": model_id,
        "model_config": {},
        "seq_len": None,
        "input_shape": None,
        "num_classes": None,
    }


if __name__ == "__main__":
    sys.exit(main())
