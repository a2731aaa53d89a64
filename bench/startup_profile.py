"""Where a trial's start-up goes, process by process: one grid point, bare DeepSpeed and ray_zero.

    python bench/startup_profile.py experiments/quick.yaml --set 'grid.stage=[1]' --set 'grid.num_workers=[2]' \
        --output /tmp/startup

Both runs set PYTHONPROFILEIMPORTTIME=1, so every Python process logs its imports. The ray_zero run
uses a private Ray whose session logs are kept: for every process Ray started, which actor it hosts,
when its log began and what it imported (the eight slowest top-level imports); and Ray Train's own
worker-group timings from its controller log. Writes `startup.md` in the output folder.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( +)(\S+)")


def top_imports(text: str, keep: int = 8) -> tuple[float, list[tuple[float, str]]]:
    """Seconds spent in top-level imports, and the slowest of them, from -X importtime output."""
    tops = [(int(m.group(1)) / 1e6, m.group(3)) for m in map(IMPORT_LINE.match, text.splitlines())
            if m and len(m.group(2)) == 1]
    return sum(t for t, _ in tops), sorted(tops, reverse=True)[:keep]


def _log_start(path: Path) -> float | None:
    """The first timestamp of a Ray core-worker log ("[2026-11-30 00:04:28,783 I ...")."""
    for line in path.open(errors="replace"):
        if line.startswith("["):
            return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def ray_processes(logs: Path) -> list[dict]:
    """One entry per Python process Ray started: actor, log start, imports."""
    processes = []
    for err in sorted(logs.glob("worker-*.err")):
        pid = err.stem.rsplit("-", 1)[1]
        out = err.with_suffix(".out")
        names = re.findall(r":actor_name:(\S+)", out.read_text(errors="replace")) if out.exists() else []
        core = next(logs.glob(f"python-core-worker-*_{pid}.log"), None)
        seconds, slowest = top_imports(err.read_text(errors="replace"))
        processes.append({"pid": pid, "actor": " ".join(dict.fromkeys(names)) or "(idle)",
                          "log_started_at": _log_start(core) if core else None,
                          "imports_s": seconds, "slowest": slowest})
    return sorted(processes, key=lambda p: p["log_started_at"] or 0)


def controller_timings(logs: Path) -> list[str]:
    """Ray Train's own worker-group start-up lines (its controller logs them at DEBUG)."""
    lines = []
    for path in logs.glob("train/ray-train-sys-controller-*.log"):
        for line in path.open(errors="replace"):
            record = json.loads(line)
            message = record["message"].split("\n")[0]
            if any(k in message for k in ("Initialization]", "Requesting", "Launched", "launched", "Shutting")):
                lines.append(f"{record['asctime'][11:]} {message}")
    return lines


def profile_ray(experiment, output: Path) -> list[str]:
    import ray
    from ray_zero.sweep import run_sweep

    context = ray.init(dashboard_host="127.0.0.1", configure_logging=False)
    try:
        run_sweep(experiment, output / "ray_zero", command="bench/startup_profile.py")
        logs = Path(context.address_info["session_dir"]) / "logs"
        shutil.copytree(logs / "train", output / "ray_logs" / "train", dirs_exist_ok=True)
        processes, timings = ray_processes(logs), controller_timings(logs)
    finally:
        ray.shutdown()
    row = next(r for r in _trials(output / "ray_zero"))
    origin = row["fit_started_at"]
    lines = ["## ray_zero: every process Ray started, in order (seconds from TorchTrainer.fit)", "",
             "| pid | actor | log began | top-level imports (s) | slowest imports (s) |", "|---|---|---|---|---|"]
    for p in processes:
        began = f"{p['log_started_at'] - origin:+.2f}" if p["log_started_at"] else "-"
        slowest = ", ".join(f"{name} {sec:.2f}" for sec, name in p["slowest"][:5])
        lines.append(f"| {p['pid']} | {p['actor']} | {began} | {p['imports_s']:.2f} | {slowest} |")
    lines += ["", "## ray_zero: Ray Train's controller log", "", "```", *timings, "```", ""]
    lines += ["## ray_zero: the trial's marks (seconds from TorchTrainer.fit; slowest rank)", ""]
    marks = {k: row[k] for k in ("driver_process_started_at", "tune_started_at", "driver_started_at",
                                 "fit_started_at", "fit_finished_at", "tune_finished_at")}
    for rank in row["per_rank"]:
        for key, value in rank.items():
            if key.endswith("_at") and isinstance(value, (int, float)):
                marks[key] = max(marks.get(key, value), value)
    lines += [f"- {k}: {v - origin:+.2f}" for k, v in sorted(marks.items(), key=lambda kv: kv[1])]
    return lines + [""]


def _trials(folder: Path):
    from ray_zero.report import load_trials
    return [r for r in load_trials(folder) if r.get("status") == "ok"]


def profile_bare(experiment, point, precision: str, use_gpu: bool, output: Path) -> list[str]:
    from bench import run_bare

    logs = output / "bare_logs"
    row = run_bare(experiment, point, precision, use_gpu, Path(tempfile.mkdtemp(prefix="bare-")),
                   torchrun_args=["--log-dir", str(logs), "--redirects", "2"])
    lines = ["## bare DeepSpeed: each rank's imports", "", "| rank | top-level imports (s) | slowest imports (s) |",
             "|---|---|---|"]
    for err in sorted(logs.rglob("stderr.log")):
        seconds, slowest = top_imports(err.read_text(errors="replace"))
        lines.append(f"| {err.parent.name} | {seconds:.2f} | "
                     f"{', '.join(f'{name} {sec:.2f}' for sec, name in slowest[:5])} |")
    lines += ["", "## bare DeepSpeed: phases (seconds, slowest rank)", ""]
    lines += [f"- {k[5:]}: {v:.2f}" for k, v in row.items() if k.startswith("bare ")]
    return lines + [""]


def main() -> None:
    from bench import require_new_output
    from ray_zero.config import load_experiment
    from ray_zero.sweep import local_cluster, plan_sweep

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="as for ray_zero sweep")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    require_new_output(parser, args.output)
    experiment = load_experiment(args.experiment, args.overrides).with_absolute_data_dir()
    plan = plan_sweep(experiment, local_cluster())
    if len(plan.runnable) != 1:
        sys.exit(f"startup_profile: the grid must have exactly one runnable point (it has "
                 f"{len(plan.runnable)}); narrow it with --set grid.KEY=[VALUE]")
    args.output.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPROFILEIMPORTTIME"] = "1"  # inherited by torchrun's ranks and by Ray's processes
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# Start-up profile: {experiment.name}, {plan.runnable[0]}", "",
             f"- date: {started}", f"- command: python bench/startup_profile.py {' '.join(sys.argv[1:])}", ""]
    lines += profile_bare(experiment, plan.runnable[0], plan.precision, plan.use_gpu, args.output)
    lines += profile_ray(experiment, args.output)
    (args.output / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
