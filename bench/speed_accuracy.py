"""The predicted step time against every committed one-GPU row (issue 67): samples/s measured over
samples/s predicted, per set of the split (bench/speed_split.json) and per GPU type.

Each row is predicted as `estimate --profile FILE` predicts its point (ray_zero/report/estimate.py's
point_speed): its folder's experiment.yaml rebuilt as bench/trace_accuracy.py rebuilds it (the model
alone, report/retrace.model_experiment), the step traced on the meta device at the row's micro-batch, each
traced kernel costed on the GPU type's profile, the host's launches and the engine's hooks beside them, an
AdamW step over the parameters the rank steps. One worker: nothing is sent, so no bandwidth is needed.
A row with no prediction (no experiment.yaml, a model that cannot be described or traced, no measured
samples/s) is counted and listed with its reason.

The held-out third is printed only with `--set all` (the final run): while developing, the tuning rows
alone. `--cross h100->h200` predicts the H200 rows from the H100 profile scaled by the profiles' ratio:
each (kernel class, dtype) curve of the H100 profile multiplied by the H200's rate over the H100's at the
largest size both measured (the class's plateau; a class the H200 profile lacks is left as it is), and the
host's seconds per launch and per hook by their ratio (that is, the H200's).

`--device cpu` predicts the committed one-worker CPU rows (memory_kind cpu_rss) from a CPU profile
(`python -m ray_zero profile --device cpu`): a check of the machinery end to end on a CPU-only machine,
not the issue's GPU target; they are outside the split (its families are the GPU rows').

    python bench/speed_accuracy.py --profile h100=H100.json --profile h200=H200.json \\
        [--cross h100->h200] [--set tuning|all] [--jsonl OUT]
    python bench/speed_accuracy.py --device cpu --profile cpu=/tmp/cpu_profile.json --set all
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import speed_split  # noqa: E402
from trace_accuracy import Traces  # noqa: E402

from ray_zero.config import Point  # noqa: E402
from ray_zero.measure.gpu_profile import Profile, read_profile  # noqa: E402
from ray_zero.models.describe import describe_lengths  # noqa: E402
from ray_zero.report.estimate import point_speed  # noqa: E402
from ray_zero.report.retrace import model_experiment  # noqa: E402
from ray_zero.rows import EARLIER_DEFAULTS  # noqa: E402
from ray_zero.store import read_experiment_file  # noqa: E402
from ray_zero.train.grid_trace import Traced, trace_key  # noqa: E402

WITHIN = 0.25
"""The issue's second bound: a row within 25 % of its prediction."""


def scaled_profile(base: Profile, target: Profile) -> Profile:
    """`base`'s curves carried to `target`'s GPU by the profiles' ratio alone: each (kind, dtype) curve
    times target's rate over base's at the largest size both measured (unchanged where target lacks the
    class), and target's seconds per launch and per hook."""
    curves = {}
    for key, points in base.curves.items():
        if key in target.curves:
            top = min(points[-1][0], target.curves[key][-1][0])
            ratio = target.rate(*key, top) / base.rate(*key, top)
        else:
            ratio = 1.0
        curves[key] = [(size, rate * ratio) for size, rate in points]
    label = f"{base.source} scaled to {target.source} by their ratio"
    return replace(base, source=label, curves=curves, launch_s=target.launch_s, hook_s=target.hook_s,
                   hardware=target.hardware)  # fmt: skip


class Folder:
    """A results folder's model, rebuilt once: its experiment, description, and traces (shared)."""

    def __init__(self, folder: Path, traces: Traces):
        saved = read_experiment_file(folder)
        if not saved.get("experiment"):
            raise LookupError("no experiment.yaml in the folder")
        self.experiment = model_experiment(saved["experiment"], str(folder))
        self.model = describe_lengths(self.experiment.model_source(), self.experiment.grid.seq_len)
        self.traces = traces


def point_of(row: dict) -> Point:
    row = {**EARLIER_DEFAULTS, **row}
    return Point(row["backend"], row["stage"], row["micro_batch_size"], row["num_workers"],
                 bool(row["activation_checkpointing"]), row["offload_optimizer"] or "none")  # fmt: skip


def predict_rows(rows: list[dict], profiles: dict[str, Profile], traces: Traces) -> list[dict]:
    """Each row (speed_split.committed_rows's) with "predicted" (point_speed's dict) or "reason"; a row is
    predicted on the profile named by its GPU type."""
    out, folders = [], {}
    by_folder = defaultdict(list)
    for r in rows:
        by_folder[r["folder"]].append(r)
    for name, mine in by_folder.items():
        try:
            folder = folders.setdefault(name, Folder(ROOT / name, traces))
        except Exception as error:  # every row of the folder is listed with it
            reason = " ".join(f"{type(error).__name__}: {error}".split())[:160]
            out += [{**r, "reason": reason} for r in mine]
            continue
        for precision in sorted({r["row"]["precision"] for r in mine}):
            same = [r for r in mine if r["row"]["precision"] == precision]
            points = [point_of(r["row"]) for r in same]
            try:
                traced = traces.get(folder.experiment, precision, points)
            except Exception as error:
                reason = " ".join(f"trace: {type(error).__name__}: {error}".split())[:160]
                out += [{**r, "reason": reason} for r in same]
                continue
            for r, point in zip(same, points):
                out.append({**r, **_predicted(r, point, folder, traced, precision, profiles)})
    return out


def _predicted(r, point, folder, traced, precision, profiles) -> dict:
    if not r["row"].get("samples_per_s"):
        return {"reason": "no measured samples/s"}
    if r["profile"] not in profiles:
        return {"reason": f"no profile for {r['profile']}"}
    outcome = traced[trace_key(point.backend, precision, point.activation_checkpointing)]
    if not isinstance(outcome, Traced):
        return {"reason": f"not traced: {outcome}"[:160]}
    profile = profiles[r["profile"]]
    speed = point_speed(point, outcome, folder.model, profile, folder.experiment, precision, None)
    if not speed.get("predicted_samples_per_s"):
        return {"reason": f"no traced step at micro-batch {point.micro_batch_size}"}
    return {"predicted": speed, "ratio": r["row"]["samples_per_s"] / speed["predicted_samples_per_s"]}


def summary(rows: list[dict]) -> str:
    """A table line: rows, predicted, none, median |m/p - 1|, within 25 %, range, bound counts."""
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    none = sum("reason" in r for r in rows)
    if not ratios:
        return f"{len(rows)} | 0 | {none} | - | - | - | - |"
    median = statistics.median(abs(x - 1) for x in ratios)
    within = sum(abs(x - 1) <= WITHIN for x in ratios) / len(ratios)
    bounds = Counter(r["predicted"]["bound"] for r in rows if "ratio" in r)
    said = ", ".join(f"{b} {n}" for b, n in bounds.most_common())
    return (f"{len(rows)} | {len(ratios)} | {none} | {median:.1%} | {within:.0%} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} | {said} |")  # fmt: skip


def table(rows: list[dict], shown: list[str]) -> str:
    head = ("| set | device | rows | predicted | no prediction | median abs(m/p - 1) | within 25 % | "
            "m/p range | bound (predicted rows) |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["set"], r["device"])].append(r)
    for (side, device), mine in sorted(groups.items()):
        if side in shown:
            lines.append(f"| {side} | {device} | {summary(mine)}")
    families = defaultdict(list)
    for r in rows:
        if r["set"] in shown and "ratio" in r:
            families[(r["set"], r["device"], r["family"])].append(r)
    lines += ["", "| set | device | family | rows | m/p median | range | bound |", "|---" * 7 + "|"]
    for (side, device, family), mine in sorted(families.items()):
        ratios = [r["ratio"] for r in mine]
        bounds = Counter(r["predicted"]["bound"] for r in mine)
        lines.append(f"| {side} | {device} | {family} | {len(mine)} | {statistics.median(ratios):.3f} | "
                     f"{min(ratios):.3f}-{max(ratios):.3f} | "
                     f"{', '.join(f'{b} {n}' for b, n in bounds.most_common())} |")  # fmt: skip
    missing = Counter((r["set"], r["device"], r["folder"], r["reason"]) for r in rows if "reason" in r)
    if missing:
        lines += ["", "Rows with no prediction (set, device, folder: rows, reason):"]
        for (side, device, folder, reason), n in sorted(missing.items()):
            if side in shown:
                lines.append(f"- {side}, {device}, {folder}: {n}, {reason}")
            else:
                lines.append(f"- {side}, {device}: {n} rows (shown with --set all)")
    return "\n".join(dict.fromkeys(lines))  # the held-out set's hidden lines once


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", default=[], metavar="GPU=FILE",
                        help="a profile file per GPU type: h100=FILE, h200=FILE (cpu=FILE with --device cpu)")
    parser.add_argument("--cross", action="append", default=[], metavar="FROM->TO",
                        help="also predict TO's rows from FROM's profile scaled by the profiles' ratio")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: the H100 and H200 rows (the split's); cpu: the one-worker CPU rows")
    parser.add_argument("--set", choices=("tuning", "all"), default="tuning", dest="sets",
                        help="tuning: the tuning rows only (while developing); all: held-out too (final run)")
    parser.add_argument("--jsonl", type=Path, help="write each row's prediction here")
    args = parser.parse_args(argv)  # fmt: skip
    started = time.time()
    profiles = {}
    for item in args.profile:
        name, _, path = item.partition("=")
        profiles[name.lower()] = read_profile(Path(path))
    split = speed_split.load_split()
    if args.device == "cpu":
        rows = [{**r, "set": "outside (CPU)", "device": "cpu", "profile": "cpu"}
                for r in speed_split.committed_rows("cpu_rss")]  # fmt: skip
    else:
        rows = [{**r, "set": speed_split.side_of(r["family"], split), "device": r["gpu"], "profile": r["gpu"]}
                for r in speed_split.split_rows()]  # fmt: skip
    for cross in args.cross:
        source, _, target = cross.lower().partition("->")
        if source not in profiles or target not in profiles:
            parser.error(f"--cross {cross}: give --profile {source}=FILE and --profile {target}=FILE")
        profiles[cross.lower()] = scaled_profile(profiles[source], profiles[target])
        rows += [{**r, "device": f"{target} from {source} profile", "profile": cross.lower()}
                 for r in rows if r["device"] == target]  # fmt: skip
    shown = ["tuning", "outside (CPU)"] + (["held-out", "outside"] if args.sets == "all" else [])
    predicted = predict_rows(rows, profiles, Traces())
    print(f"Profiles: {'; '.join(f'{k}: {p.source}' for k, p in profiles.items())}")
    print(f"Split: bench/speed_split.json (seed {split['seed']}); shown: {', '.join(shown)}\n")
    print(table(predicted, shown))
    print(f"\n{len(predicted)} rows in {time.time() - started:.0f} s")
    if args.jsonl:
        kept = [r for r in predicted if r["set"] in shown]
        args.jsonl.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "row"}
                                                 | {"trial": r["row"].get("trial"),
                                                    "measured_samples_per_s": r["row"].get("samples_per_s")},
                                                 default=str) + "\n" for r in kept))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
