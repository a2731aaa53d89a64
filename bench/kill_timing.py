"""Kill a trial's Ray Train worker from outside at chosen moments of its start, and print what came of each
trial: its status, its attempts and how long its sweep took. One private Ray with 2 CPUs, one stage-1 trial
of quick.yaml at a time with one retry (runtime.max_failures=1), each worker reserving one CPU: a placement
group that a failed start left reserved shows as a sweep that never ends.

    python bench/kill_timing.py 0 1 2 3            # seconds after the (first) worker process appears
    python bench/kill_timing.py --workers 2 0 1 2

`attempts` counts the attempts whose ranks began training (ray_zero.run.trial.train_loop counts them as each
rank starts): a worker killed before it reached the training function leaves no attempt behind.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray
from common import ROOT

sys.path.insert(0, str(ROOT))
from ray_zero.experiment_file import load_experiment  # noqa: E402
from ray_zero.run.sweep import run_sweep  # noqa: E402


def train_worker() -> psutil.Process | None:
    """A Ray Train worker of this process's own Ray (Ray's processes descend from the process that started it:
    another Ray on the machine is left alone)."""
    for process in psutil.Process().children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(process.cmdline()):
                return process
        except psutil.NoSuchProcess:
            continue
    return None


def kill_after(delay_s: float, steps: int, patience_s: float, workers: int) -> str:
    experiment = load_experiment(
        ROOT / "experiments" / "quick.yaml",
        [
            f"steps={steps}",
            "warmup_steps=2",
            "grid.stage=[1]",
            f"grid.num_workers=[{workers}]",
            "runtime.max_failures=1",
        ],
    )
    result: dict = {}
    started = time.time()
    sweep = threading.Thread(
        target=lambda: result.update(
            frame=run_sweep(experiment, Path(tempfile.mkdtemp()), command="bench/kill_timing.py")
        ),
        daemon=True,
    )
    sweep.start()
    victim = None
    while victim is None and time.time() - started < 120:
        victim = train_worker()
        time.sleep(0.05)
    if victim is None:
        return "no worker process appeared in 120 s"
    appeared = time.time() - started
    time.sleep(delay_s)
    victim.send_signal(signal.SIGKILL)
    sweep.join(timeout=patience_s)
    said = f"worker appeared at {appeared:.1f} s, killed {delay_s} s later:"
    if sweep.is_alive():
        return f"{said} no end within {patience_s:.0f} s"
    if "frame" not in result:
        return f"{said} the sweep raised (its traceback above)"
    row = result["frame"].iloc[0]
    error = f" ({row['error']})" if isinstance(row["error"], str) else ""
    return f"{said} {row['status']}, {row['attempts']} attempts, sweep {time.time() - started:.1f} s{error}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("delays", nargs="+", type=float, help="seconds after the worker process appears")
    parser.add_argument(
        "--steps", type=int, default=300, help="steps a trial trains (long enough to kill it in)"
    )
    parser.add_argument("--patience", type=float, default=300, help="seconds to wait for a sweep to end")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        choices=(1, 2),
        help="workers of the trial (2: one of them is killed; a leaked group holds both CPUs)",
    )
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    for delay in args.delays:
        outcome = kill_after(delay, args.steps, args.patience, args.workers)
        print(outcome, flush=True)
        if "no end" in outcome:
            break  # the hung sweep holds the CPUs: later trials would wait as well


if __name__ == "__main__":
    main()
