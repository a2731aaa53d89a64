"""The traced prediction, with no calibration, against every committed GPU row and calibration line.

Every ok GPU row under results/ and bench/results/ (calibration and fit-probe rows kept apart) is
predicted again by this version from its folder's experiment.yaml: the model's step traced on the meta
device (ray_zero/train/grid_trace.py), no calibration.json (`report --predict` without one). Its measured
peak over that prediction; and every calibration line (calibration.json's fits) against the traced
step's bytes per sample at the same micro-batches. Writes the tables to stdout (bench/trace_accuracy.md
holds them, with the story).

    python bench/trace_accuracy.py [--roots results bench/results] [--jsonl OUT.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_zero.config import Point, is_calibration  # noqa: E402
from ray_zero.report.retrace import model_experiment  # noqa: E402
from ray_zero.rows import EARLIER_DEFAULTS, aggregate_ranks, repredicted, traced_fields  # noqa: E402
from ray_zero.store import load_trials, read_experiment_file  # noqa: E402
from ray_zero.train.grid_trace import Traced, trace_grid, trace_key  # noqa: E402

GIB = 2**30
OFF = 0.20
"""A row further than this from its prediction is listed with its reason."""


def _family(model: str, config: dict) -> str:
    name = model.split(":")[-1]
    if name == "bert" and (config or {}).get("hidden_size") == 1024:
        return "bert-large"
    return name


class Traces:
    """Traced steps by (model source, precision, form, checkpointing), made once for every folder."""

    def __init__(self):
        self.memo: dict = {}

    def get(self, experiment, precision: str, points: list[Point]) -> dict:
        source = experiment.model_source()
        key = (source.model, json.dumps(source.model_config, sort_keys=True), source.seq_len, precision)
        sizes = sorted({p.micro_batch_size for p in points})
        wanted = {trace_key(p.backend, precision, p.activation_checkpointing) for p in points}
        have = self.memo.setdefault(key, {})
        missing = [
            p
            for p in points
            if (trace_key(p.backend, precision, p.activation_checkpointing), p.micro_batch_size) not in have
        ]  # noqa: E501
        if missing:
            for form_key, outcome in trace_grid(source, missing, precision, sizes).items():
                if isinstance(outcome, Traced):
                    for step in outcome.steps:
                        have[(form_key, step.micro_batch)] = step
                else:
                    have[(form_key, None)] = outcome
        out = {}
        for form_key in wanted:
            steps = sorted((s for (k, m), s in have.items() if k == form_key and m is not None),
                           key=lambda s: s.micro_batch)  # fmt: skip
            out[form_key] = Traced(tuple(steps)) if steps else have.get((form_key, None), "not traced")
        return out


def folders(roots: list[str]) -> list[Path]:
    found = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("trials.jsonl*")):
            if (path.parent / "experiment.yaml").is_file():
                found.append(path.parent)
    return found


def predict_folder(folder: Path, traces: Traces) -> list[dict]:
    saved = read_experiment_file(folder)
    experiment = model_experiment(saved["experiment"], str(folder))
    rows = []
    for row in load_trials(folder):
        if row.get("memory_kind") != "cuda" or row.get("status") != "ok":
            continue
        if row.get("per_rank"):
            row.update(aggregate_ranks(row["per_rank"]))
        rows.append({**EARLIER_DEFAULTS, **row})
    if not rows:
        return []
    out = []
    for precision in sorted({r["precision"] for r in rows}):
        mine = [r for r in rows if r["precision"] == precision]
        points = [Point(r["backend"], r["stage"], r["micro_batch_size"], r["num_workers"],
                        bool(r["activation_checkpointing"]), r["offload_optimizer"] or "none")
                  for r in mine]  # fmt: skip
        traced = traces.get(experiment, precision, points)
        for row in mine:
            key = trace_key(row["backend"], precision, row["activation_checkpointing"])
            row.setdefault("reduce_bucket_size", saved["experiment"].get("reduce_bucket_size", 50_000_000))
            row.update(traced_fields(row, traced[key], experiment.gradient_accumulation_steps))
            row = repredicted(row, None)
            out.append(
                dict(
                    folder=str(folder.relative_to(ROOT)),
                    trial=row["trial"],
                    kind="calibration"
                    if is_calibration(row["trial"])
                    else "probe"
                    if "_probe" in row["trial"]
                    else "grid",
                    family=_family(row["model"], experiment.model_options),
                    backend=row["backend"],
                    stage=row["stage"],
                    precision=precision,
                    micro_batch=row["micro_batch_size"],
                    workers=row["num_workers"],
                    checkpointing=bool(row["activation_checkpointing"]),
                    offload=row["offload_optimizer"],
                    measured_gib=row["peak_allocated_gib_max"],
                    predicted_gib=row["predicted_peak_gib"],
                    ratio=(row["peak_allocated_gib_max"] / row["predicted_peak_gib"])
                    if row["predicted_peak_gib"]
                    else None,  # noqa: E501
                    source=row["activation_source"],
                    note=row.get("trace_note", ""),
                    # for bench/self_correction.py: the activation term, the band, when the trial ran
                    activation_gib=row.get("predicted_activation_gib"),
                    inside_band=row.get("inside_band"),
                    band=row.get("predicted_band"),
                    started_at=row.get("fit_started_at"),
                    finished_at=row.get("fit_finished_at"),
                )
            )
    return out


def calibration_lines(folder: Path, traces: Traces) -> list[dict]:
    path = folder / "calibration.json"
    if not path.is_file():
        return []
    found = json.loads(path.read_text())
    if found.get("device") != "cuda":
        return []
    experiment = model_experiment(read_experiment_file(folder)["experiment"], str(folder))
    precision = found["precision"]
    out = []
    for fit in found.get("fits", []):
        sizes = [int(x) for x, _ in fit["points"]]
        if fit.get("bytes_per_sample") is None or len(sizes) < 2:
            continue
        points = [
            Point(fit["backend"], 0 if fit["backend"] != "fsdp" else 2, m, 1, fit["checkpointing"])
            for m in sizes
        ]
        traced = traces.get(experiment, precision, points)[
            trace_key(fit["backend"], precision, fit["checkpointing"])
        ]
        if not isinstance(traced, Traced):
            out.append(dict(folder=str(folder.relative_to(ROOT)), backend=fit["backend"], note=traced))
            continue
        # The calibration line's slope is the allocator's rise per sample; the trace's over the same sizes.
        xs = [s.micro_batch for s in traced.steps if s.micro_batch in sizes]
        ys = [s.rise(s.gradient_bytes) for s in traced.steps if s.micro_batch in sizes]
        slope = statistics.linear_regression(xs, ys)[0] if len(xs) >= 2 else None
        out.append(
            dict(
                folder=str(folder.relative_to(ROOT)),
                family=_family(experiment.model, experiment.model_options),
                backend=fit["backend"],
                precision=precision,
                sizes=sizes,
                calibrated_mib=fit["bytes_per_sample"] / 2**20,
                traced_mib=slope / 2**20 if slope else None,
                ratio=fit["bytes_per_sample"] / slope if slope else None,
            )
        )
    return out


def _stats(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    med = statistics.median(abs(r - 1) for r in ratios)
    within = sum(abs(r - 1) <= 0.10 for r in ratios) / len(ratios)
    spread = f"range {min(ratios):.3f}-{max(ratios):.3f}"
    return f"{len(ratios)} rows, median |r-1| {med:.3f}, within 10 %: {within:.0%}, {spread}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roots", nargs="*", default=["results", "bench/results"])
    parser.add_argument("--jsonl", type=Path)
    args = parser.parse_args(argv)
    traces = Traces()
    rows, lines = [], []
    for folder in folders(args.roots):
        rows += predict_folder(folder, traces)
        lines += calibration_lines(folder, traces)
    if args.jsonl:
        args.jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows + lines))
    grid = [r for r in rows if r["kind"] != "calibration" and r["ratio"] is not None]
    print("All grid and fit rows (calibration rows apart): " + _stats([r["ratio"] for r in grid]))
    unique = {}
    for r in grid:
        unique.setdefault(
            (
                r["family"],
                r["backend"],
                r["stage"],
                r["precision"],
                r["micro_batch"],
                r["workers"],
                r["checkpointing"],
                r["offload"],
            ),
            r,
        )  # noqa: E501
    print("Each point once: " + _stats([r["ratio"] for r in unique.values()]))
    print(
        "Calibration rows: " + _stats([r["ratio"] for r in rows if r["kind"] == "calibration" and r["ratio"]])
    )
    print(
        "\n| family | engine | precision | rows | measured / predicted (median, range) |"
        "\n|---|---|---|---|---|"
    )
    groups = defaultdict(list)
    for r in grid:
        groups[(r["family"], r["backend"], r["precision"])].append(r["ratio"])
    for (family, backend, precision), ratios in sorted(groups.items()):
        print(f"| {family} | {backend} | {precision} | {len(ratios)} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) |")  # fmt: skip
    cal = [c for c in lines if c.get("ratio")]
    print("\nCalibration lines, calibrated / traced bytes per sample: " + _stats([c["ratio"] for c in cal]))
    print(
        "\n| family | engine | precision | sizes | calibrated MiB/sample | traced | ratio |"
        "\n|---|---|---|---|---|---|---|"
    )
    for c in sorted(cal, key=lambda c: (c["family"], c["backend"], c["precision"])):
        print(f"| {c['family']} | {c['backend']} | {c['precision']} | {c['sizes']} "
              f"| {c['calibrated_mib']:.1f} | "
              f"{c['traced_mib']:.1f} | {c['ratio']:.3f} |")  # fmt: skip
    off = sorted(
        (r for r in unique.values() if abs(r["ratio"] - 1) > OFF), key=lambda r: -abs(r["ratio"] - 1)
    )
    print(f"\nPoints more than {OFF:.0%} off:")
    for r in off:
        print(f"- {r['family']} {r['backend']} stage {r['stage']} {r['precision']} mb {r['micro_batch']} "
              f"w{r['workers']} ckpt {r['checkpointing']} offload {r['offload']}: {r['ratio']:.3f} "
              f"({r['folder']})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
