"""Where a trial's start-up goes, process by process: one grid point, bare DeepSpeed and a ray_zero sweep.

    python bench/startup_profile.py experiments/quick.yaml --set 'grid.stage=[1]' --set 'grid.num_workers=[2]'
    \
        --output /tmp/startup

Both runs set PYTHONPROFILEIMPORTTIME=1, so every Python process logs its imports. The ray_zero run uses a
private Ray whose session logs are read before it stops: for every process Ray started, which actor it
hosts, when its log began and what it imported (the slowest top-level imports); Ray Train's own
worker-group lines from its controller log; and the trial's phases from the diagnostics marks, as
bench/bench.py reports them. Writes `startup.md` in the output folder.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bare_and_ray import bare_spec, ray_rows, run_bare  # noqa: E402

IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( +)(\S+)")


def top_imports(text: str, keep: int = 5) -> tuple[float, str]:
    """Seconds in top-level imports, and the slowest of them, from -X importtime output."""
    tops = [
        (int(m.group(1)) / 1e6, m.group(3))
        for m in map(IMPORT_LINE.match, text.splitlines())
        if m and len(m.group(2)) == 1
    ]
    slowest = ", ".join(f"{name} {seconds:.2f}" for seconds, name in sorted(tops, reverse=True)[:keep])
    return sum(t for t, _ in tops), slowest


def _log_start(path: Path) -> float | None:
    """The first timestamp of a Ray core-worker log ("[2026-11-30 00:04:28,783 I ...")."""
    for line in path.open(errors="replace"):
        if line.startswith("["):
            return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def ray_processes(logs: Path, origin: float) -> list[str]:
    """A table row per Python process Ray started: actor, when its log began (from fit()), imports."""
    processes = []
    for err in sorted(logs.glob("worker-*.err")):
        pid = err.stem.rsplit("-", 1)[1]
        out = err.with_suffix(".out")
        names = re.findall(r":actor_name:(\S+)", out.read_text(errors="replace")) if out.exists() else []
        core = next(logs.glob(f"python-core-worker-*_{pid}.log"), None)
        began = _log_start(core) if core else None
        seconds, slowest = top_imports(err.read_text(errors="replace"))
        processes.append(
            (
                began or 0,
                f"| {pid} | {' '.join(dict.fromkeys(names)) or '(idle)'} | "
                f"{f'{began - origin:+.2f}' if began else '-'} | {seconds:.2f} | {slowest} |",
            )
        )
    return [line for _, line in sorted(processes)]


def controller_lines(logs: Path) -> list[str]:
    """Ray Train's own worker-group start-up lines (its controller logs them, JSON lines)."""
    lines = []
    for path in logs.glob("train/ray-train-sys-controller-*.log"):
        for line in path.open(errors="replace"):
            record = json.loads(line)
            message = record["message"].split("\n")[0]
            if any(
                k in message for k in ("Initialization]", "Requesting", "Launched", "launched", "Shutting")
            ):
                lines.append(f"{record['asctime'][11:]} {message}")
    return lines


def phase_lines(row: dict, prefix: str) -> list[str]:
    return [f"- {k[len(prefix) + 1 :]}: {v:.2f}" for k, v in row.items() if k.startswith(prefix + " ")]


def profile_ray(experiment, output: Path) -> list[str]:
    import ray

    from ray_zero.run.sweep import run_sweep

    context = ray.init(dashboard_host="127.0.0.1", configure_logging=False, log_to_driver=False)
    try:
        called_at = time.time()
        run_sweep(experiment, output / "ray_zero", command="bench/startup_profile.py", diagnostics=True)
        logs = Path(context.address_info["session_dir"]) / "logs"
        shutil.copytree(logs / "train", output / "ray_logs" / "train", dirs_exist_ok=True)
        row = ray_rows(output / "ray_zero", called_at)[0]
        processes, controller = ray_processes(logs, row["marks"]["fit_started_at"]), controller_lines(logs)
    finally:
        ray.shutdown()
    return [
        "## ray_zero: every process Ray started, in order (log began: seconds from TorchTrainer.fit)",
        "",
        "| pid | actor | log began | top-level imports (s) | slowest imports (s) |",
        "|---|---|---|---|---|",
        *processes,
        "",
        "## ray_zero: Ray Train's controller log",
        "",
        "```",
        *controller,
        "```",
        "",
        f"## ray_zero: phases (seconds, slowest rank; {row['ray_zero_wall_s']:.2f} s from the sweep's call "
        "to the trial's row)",
        "",
        *phase_lines(row, "ray"),
        "",
    ]


def profile_bare(spec, output: Path) -> list[str]:
    logs = output / "bare_logs"
    workdir = Path(tempfile.mkdtemp(prefix="bare-"))
    row = run_bare(spec, workdir, torchrun_args=["--log-dir", str(logs), "--redirects", "2"])
    lines = [
        "## bare DeepSpeed: each rank's imports",
        "",
        "| rank | top-level imports (s) | slowest imports (s) |",
        "|---|---|---|",
    ]
    for err in sorted(logs.rglob("stderr.log")):
        seconds, slowest = top_imports(err.read_text(errors="replace"))
        lines.append(f"| {err.parent.name} | {seconds:.2f} | {slowest} |")
    return lines + [
        "",
        f"## bare DeepSpeed: phases (seconds, slowest rank; {row['wall_s']:.2f} s in all)",
        "",
        *phase_lines(row, "bare"),
        "",
    ]


def main() -> None:
    from ray_zero.experiment_file import load_experiment
    from ray_zero.models.describe import describe_model
    from ray_zero.run.plan import local_cluster, plan_sweep

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="as for ray_zero sweep")
    parser.add_argument("--output", type=Path, required=True, help="a new folder")
    args = parser.parse_args()
    if args.output.is_dir() and any(args.output.iterdir()):
        parser.error(f"--output {args.output} is not empty: give a new folder")
    experiment = load_experiment(args.experiment, args.overrides).with_absolute_paths()
    plan = plan_sweep(experiment, local_cluster())
    if len(plan.runnable) != 1:
        parser.error(
            f"the grid must have exactly one runnable point (it has {len(plan.runnable)}); narrow it "
            "with --set grid.KEY=[VALUE]"
        )
    point = plan.runnable[0]
    model = describe_model(experiment.model_source())
    args.output.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPROFILEIMPORTTIME"] = "1"  # inherited by torchrun's ranks and by Ray's processes
    lines = [
        f"# Start-up profile: {experiment.name}, {point.name}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- command: python bench/startup_profile.py {' '.join(sys.argv[1:])}",
        "",
    ]
    lines += profile_bare(bare_spec(experiment, point, plan, model, args.output), args.output)
    lines += profile_ray(experiment, args.output)
    (args.output / "startup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
