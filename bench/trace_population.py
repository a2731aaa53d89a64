"""Does the traced step (ray_zero/train/grid_trace.py) run on every model family a user may bring?

The conformance population (bench/conformance.py: the smallest model of every timm family, every
Transformers type ray_zero trains, shrunk), each traced on the meta device at micro-batches 2 and 4 in
bf16 as DeepSpeed runs it and in fp32 under bf16 autocast as DDP runs it, each model in a child process
with a time limit. A model passes when both forms trace and the traced rise grows with the micro-batch;
otherwise its one-line reason (then a sweep calibrates it instead). One JSON line per model in
OUTPUT/trace_population.jsonl (a rerun skips those there); the summary and the reasons, counted, on stdout.

    nice -n 19 python bench/trace_population.py --output /tmp/conf [--only hf:gpt2 timm:resnet18]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

FORMS = (("deepspeed", "bf16"), ("torch_zero", "bf16"))
SIZES = (2, 4)


def trace_case(case: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from ray_zero.config import Point
    from ray_zero.models.source import ModelSource
    from ray_zero.train.grid_trace import Traced, trace_grid, trace_key

    source = ModelSource(
        case["model"], case["model_config"], case["seq_len"], case["input_shape"], case["num_classes"]
    )
    result = {"id": case["id"], "forms": {}}
    for backend, precision in FORMS:
        started = time.perf_counter()
        points = [Point(backend, 0 if backend != "fsdp" else 2, size, 1) for size in SIZES]
        outcome = trace_grid(source, points, precision)[trace_key(backend, precision, False)]
        if isinstance(outcome, Traced):
            rises = [outcome.rise(size, 0.0) for size in SIZES]
            grows = rises[1] > rises[0] > 0
            result["forms"][backend] = {
                "status": "traced" if grows else "flat",
                "rises": rises,
                "attention": dict(outcome.steps[0].attention),
                "seconds": time.perf_counter() - started,
            }
        else:
            result["forms"][backend] = {"status": "not traced", "reason": outcome}
    return result


def _child(case: dict, connection) -> None:
    try:
        connection.send(trace_case(case))
    except Exception as error:  # noqa: BLE001  the model's own failure, one line
        connection.send({"id": case["id"], "error": f"{type(error).__name__}: {error}"[:300]})


def run_one(case: dict, timeout_s: float) -> dict:
    context = mp.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(case, sender), daemon=True)
    process.start()
    if receiver.poll(timeout_s):
        result = receiver.recv()
    else:
        result = {"id": case["id"], "error": f"timeout after {timeout_s:.0f} s"}
    process.kill()
    process.join()
    return result


def summary(path: Path) -> str:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    lines = [f"{len(records)} models"]
    for backend, _ in FORMS:
        status = collections.Counter(
            r.get("forms", {}).get(backend, {}).get("status", "error") for r in records
        )
        lines.append(f"{backend}: " + ", ".join(f"{k} {v}" for k, v in status.most_common()))
    reasons = collections.Counter()
    for r in records:
        for form in r.get("forms", {}).values():
            if form["status"] == "not traced":
                reasons[form["reason"][:110]] += 1
        if "error" in r:
            reasons[r["error"][:110]] += 1
    lines.append("reasons:")
    lines += [f"  {count} x {reason}" for reason, count in reasons.most_common(25)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--timeout-s", type=float, default=120)
    args = parser.parse_args(argv)
    from conformance import load_population

    args.output.mkdir(parents=True, exist_ok=True)
    cases = load_population(args.output)
    if args.only:
        cases = [c for c in cases if c["model"] in args.only or c["id"] in args.only]
    out = args.output / "trace_population.jsonl"
    done = {json.loads(line)["id"] for line in out.read_text().splitlines()} if out.is_file() else set()
    with open(out, "a") as sink:
        for case in cases:
            if case["id"] in done:
                continue
            sink.write(json.dumps(run_one(case, args.timeout_s)) + "\n")
            sink.flush()
    print(summary(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
