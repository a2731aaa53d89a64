"""Issue 56's tables from scripts/gpu-scaling.sh's folders: per point, the measured peak per rank over the
prediction stored in its row; samples/s measured beside what its engine's fewest-worker row and the
measured bus bandwidth predict (ray_zero/report/speed_estimate.py); and the bytes per collective a rank
sent beside the communication model's. Then the share of points within 5 % (memory) and 15 % (speed), and
whether the bytes are equal for every engine.

    python scripts/scaling_table.py SWEEP_DIR... --bandwidth bandwidth-8.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_zero.config import is_calibration  # noqa: E402
from ray_zero.measure.bandwidth import read_bandwidth  # noqa: E402
from ray_zero.report.frame import finish_recorded  # noqa: E402
from ray_zero.report.speed_estimate import speed_table  # noqa: E402
from ray_zero.store import load_trials, read_experiment_file  # noqa: E402

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def rows_of(folder: Path) -> tuple[list[dict], dict]:
    saved = read_experiment_file(folder)
    rows = [finish_recorded(r, saved["experiment"], None) for r in load_trials(folder)]
    ok = [r for r in rows if r.get("status") == "ok" and not is_calibration(r["trial"])]
    return ok, saved


def memory_lines(folder: Path, rows: list[dict]) -> list[tuple[str, float]]:
    return [
        (f"{folder.name} {r['trial']}", r["peak_allocated_gib_max"] / r["predicted_peak_gib"])
        for r in rows
        if r.get("predicted_peak_gib")
    ]


def speed_lines(folder: Path, rows: list[dict], saved: dict, bandwidth) -> list[tuple[str, float]]:
    model, experiment = types.SimpleNamespace(**saved["model"]), saved["experiment"]
    workers = sorted({int(r["num_workers"]) for r in rows})
    table = speed_table(
        rows, model, workers, bandwidth, experiment["reduce_bucket_size"],
        experiment.get("gradient_accumulation_steps", 1),
    )  # fmt: skip
    found = []
    for line in table.to_dict("records"):
        if line["measured"] and line["workers"] != line["from_workers"]:
            name = f"{folder.name} {line['backend']} stage {line['stage']} w{line['workers']}"
            found.append((name, line["samples_per_s"] / line["measured"]))
    return found


def byte_lines(folder: Path, rows: list[dict]) -> list[tuple[str, str, int, int]]:
    found = []
    for r in rows:
        for kind in KINDS:
            sent, predicted = r.get(f"comm_{kind}_bytes"), r.get(f"predicted_comm_{kind}_bytes")
            if sent is not None and predicted is not None and (sent or predicted):
                found.append((f"{folder.name} {r['trial']}", kind, int(sent), int(predicted)))
    return found


def share(ratios: list[float], within: float) -> str:
    if not ratios:
        return "no points"
    inside = sum(abs(r - 1) <= within for r in ratios)
    med = statistics.median(abs(r - 1) for r in ratios)
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    return f"{inside}/{len(ratios)} within {within:.0%} (median |r-1| {med:.3f}, {spread})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--bandwidth", type=Path, required=True, help="a file of `ray_zero bandwidth`")
    args = parser.parse_args(argv)
    bandwidth = read_bandwidth(args.bandwidth)
    memory, speed, sent = [], [], []
    for folder in args.folders:
        rows, saved = rows_of(folder)
        memory += memory_lines(folder, rows)
        speed += speed_lines(folder, rows, saved, bandwidth)
        sent += byte_lines(folder, rows)
    print("| point | measured / predicted peak |\n|---|---|")
    print("\n".join(f"| {name} | {ratio:.3f} |" for name, ratio in memory))
    print("\n| point | predicted / measured samples/s |\n|---|---|")
    print("\n".join(f"| {name} | {ratio:.3f} |" for name, ratio in speed))
    print("\n| point | collective | bytes sent | communication model |\n|---|---|---|---|")
    print("\n".join(f"| {n} | {k} | {s:,} | {p:,} |" for n, k, s, p in sent))
    print(f"\nmemory: {share([r for _, r in memory], 0.05)}")
    print(f"speed: {share([r for _, r in speed], 0.15)}")
    unequal = [line for line in sent if line[2] != line[3]]
    print(f"bytes: {len(sent) - len(unequal)} of {len(sent)} equal to the model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
