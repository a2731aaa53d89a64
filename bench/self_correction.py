"""Issue 65 item 4, replayed on committed GPU rows: had each run corrected itself as ray_zero now does
(ray_zero/measure/correction.py: a trial measured above its band hands its measured activation term to the
trials of its engine that start after it), how close would those later trials' planned peaks have been?

Two sources, each a list of runs whose rows are replayed in the order they ran:
* every committed sweep and fit folder, predicted again by this version (bench/trace_accuracy.py --jsonl:
  its rows carry the activation term, the band, and when each trial started and ended); a row is
  corrected by the misses of rows of its folder that ended before it started;
* the GPU population's tuning families (issue 65), each family's four forms run one after another in one
  process (ZeRO-1 bf16, ZeRO-3 fp16 checkpointed, FSDP2 bf16, DDP + ZeRO-1 bf16 checkpointed), with the
  predictions of bench/population_predict.py (OUTPUT/predicted.jsonl, made with the activation term).

For three keys a correction carries over within: the engine (backend and checkpointing: what ray_zero
does), checkpointing alone, the whole model. Prints, per source and key, the rows a correction reached and
their |measured/planned - 1|, inside the band, under the band's lower end (planned too high) and above its
upper end (still under-planned), before and after.

    python bench/trace_accuracy.py --jsonl /tmp/trace.jsonl
    python bench/self_correction.py --trace /tmp/trace.jsonl [--population bench/results/population-h100]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from ray_zero.measure.correction import Correction, Corrections, from_row  # noqa: E402

KEYS = {
    "engine (ray_zero)": lambda r: (r["backend"], r["checkpointing"]),
    "checkpointing": lambda r: ("any", r["checkpointing"]),
    "model": lambda r: ("any", False),
}
FORMS = {  # the population's forms, in the order a family's process runs them
    "ds1 bf16": ("deepspeed", False),
    "ds3 fp16 ckpt": ("deepspeed", True),
    "fsdp3 bf16": ("fsdp", False),
    "ddp+zero1 bf16 ckpt": ("torch_zero", True),
}


def _band(text: str) -> tuple[float, float]:
    low, high = re.match(r"([-+][\d.]+)%/([-+][\d.]+)%", text).groups()
    return float(low) / 100, float(high) / 100


def trace_runs(path: Path) -> list[list[dict]]:
    """The folders' ok GPU rows (grid and fit probes), each folder's in the order its trials started."""
    by_folder: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") not in ("grid", "probe") or not row.get("predicted_gib") or not row.get("band"):
            continue
        by_folder.setdefault(row["folder"], []).append(row)
    runs = []
    for rows in by_folder.values():
        for index, row in enumerate(rows):
            row["order"] = index
        rows.sort(key=lambda r: (r.get("started_at") or 0.0, r["order"]))
        runs.append(rows)
    return runs


def population_runs(folder: Path) -> list[list[dict]]:
    """The population's tuning families: each family's measured forms in the order they ran."""
    from population_table import read_records

    from ray_zero.measure import error_band

    measured = {r["family"]: r for r in read_records(folder / "population.jsonl")}
    runs = []
    for line in read_records(folder / "predicted.jsonl"):
        record = measured.get(line["family"]) or {}
        kind = "timm" if record.get("source") == "timm" else "hf"
        band = str(error_band.band_for(error_band.class_of(kind, record.get("task")), "H100"))
        rows = []
        for index, (form, (backend, checkpointing)) in enumerate(FORMS.items()):
            got, ran = (line.get("forms") or {}).get(form) or {}, (record.get("forms") or {}).get(form) or {}
            if (
                ran.get("status") != "ok"
                or not got.get("predicted_peak_gib")
                or not ran.get("measured_peak_gib")
            ):
                continue
            rows.append(dict(
                folder=line["family"], trial=form, backend=backend, checkpointing=checkpointing,
                measured_gib=ran["measured_peak_gib"], predicted_gib=got["predicted_peak_gib"],
                activation_gib=got.get("predicted_activation_gib"), band=band,
                order=index, started_at=index, finished_at=index + 0.5,
            ))  # fmt: skip
        runs.append(rows)
    return runs


def _scaled(missed: dict, row: dict) -> float:
    """The rule tried first and dropped: the missed row's measured activation term over its predicted one,
    applied to this row's activation term."""
    activation = missed.get("activation_gib")
    if not activation or not row.get("activation_gib"):
        return row["predicted_gib"] * missed["measured_gib"] / missed["predicted_gib"]
    scale = (missed["measured_gib"] - (missed["predicted_gib"] - activation)) / activation
    return row["predicted_gib"] + (scale - 1) * row["activation_gib"]


RULES = {
    "excess (ray_zero)": lambda missed, correction, row: correction.peak_gib(row["predicted_gib"]),
    "activation scale": lambda missed, correction, row: _scaled(missed, row),
}


def replay(runs: list[list[dict]], key, rule) -> list[dict]:
    """Each row a correction reached: measured over predicted, and over the corrected plan."""
    reached = []
    for rows in runs:
        seen: list[tuple[dict, Correction]] = []
        for row in rows:
            lower, upper = _band(row["band"])
            started = row.get("started_at")
            found = Corrections()
            for missed, correction in seen:
                ended = missed.get("finished_at")
                if started is None or ended is None or ended <= started:
                    found.add(correction)
            mine = found.by_engine.get(key(row))
            ratio = row["measured_gib"] / row["predicted_gib"]
            if mine is not None:
                missed = next(m for m, c in seen if c is mine)
                planned = rule(missed, mine, row)
                reached.append(
                    dict(row, before=ratio, after=row["measured_gib"] / planned, lower=lower, upper=upper)
                )
            if ratio > 1 + upper:  # a miss above the band: the rows after it are planned with it
                correction = from_row(
                    {
                        "trial": row["trial"],
                        "inside_band": False,
                        "measured_over_predicted": ratio,
                        "peak_allocated_gib_max": row["measured_gib"],
                        "predicted_peak_gib": row["predicted_gib"],
                    }
                )
                seen.append((row, dataclasses.replace(correction, engine=key(row))))
    return reached


def summary(reached: list[dict]) -> str:
    if not reached:
        return "| 0 | - | - |"

    def counts(name: str) -> str:
        errors = [abs(r[name] - 1) for r in reached]
        inside = sum(1 + r["lower"] <= r[name] <= 1 + r["upper"] for r in reached)
        high = sum(r[name] < 1 + r["lower"] for r in reached)
        under = sum(r[name] > 1 + r["upper"] for r in reached)
        return f"{statistics.median(errors):.1%}, {inside} / {high} / {under}"

    runs = len({r["folder"] for r in reached})
    return f"| {len(reached)} ({runs} runs) | {counts('before')} | {counts('after')} |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="bench/trace_accuracy.py --jsonl's file")
    parser.add_argument("--population", type=Path, help="the GPU population's records folder")
    args = parser.parse_args(argv)
    sources = []
    if args.trace:
        sources.append(("committed sweeps and fits, predicted again", trace_runs(args.trace)))
    if args.population:
        sources.append(("GPU population, tuning families", population_runs(args.population)))
    print("| source | carried over within | rule | rows reached | before: median error, inside / high / "
          "under | after |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, runs in sources:
        for label, key in KEYS.items():
            for rule_name, rule in RULES.items():
                print(f"| {name} | {label} | {rule_name} {summary(replay(runs, key, rule))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
