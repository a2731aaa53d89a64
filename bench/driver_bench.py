"""Does a sweep's driver work per trial stay flat as trials accumulate? (issue 53, part 3)

A CPU sweep of many trials of a tiny factory model (examples/my_model.py, 2 steps each) through
`ray_zero.sweep`, in this process, with the recorder's `record` (what Tune's callback runs for each
finished trial, in the driver) timed row by row, and the driver process's CPU time between rows (Tune's
work, the recorder's and its drawing thread's). Reports the first and the last 50 rows' figures (and the
trials' own wall times), Tune's experiment snapshots (their CPU time, timed around Tune's own
`TuneController.save_to_dir`, not a public API: the lab's probe), and whether the pages at the end
equal what `report DIR` draws of the folder.
`--checkout DIR` runs another checkout's ray_zero the same way.

    nice python bench/driver_bench.py --trials 300 --output /tmp/driver-new
    nice python bench/driver_bench.py --trials 300 --output /tmp/driver-old --checkout /tmp/old
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the ray_zero checkout to run")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.checkout.resolve()))
    import ray_zero
    from ray_zero.run import recorder

    spent: list[tuple[str, float]] = []
    driver_cpu: list[float] = []  # this process's CPU time (Tune, the recorder, its drawing) at each row
    draws: list[tuple[float, int, float]] = []  # each drawing's CPU time, rows drawn, process CPU at its end
    original, original_draw = recorder.Recorder.record, recorder.Recorder.draw

    def timed(self, row, running):
        started = time.perf_counter()
        original(self, row, running)
        spent.append((row["trial"], time.perf_counter() - started))
        driver_cpu.append(time.process_time())

    def timed_draw(self):
        started = time.thread_time()
        original_draw(self)
        draws.append((time.thread_time() - started, self.finished, time.process_time()))

    recorder.Recorder.record, recorder.Recorder.draw = timed, timed_draw
    snapshots: list[tuple[float, int, float]] = []  # Tune's experiment snapshots: CPU time, rows, process CPU
    try:  # Tune's own (not public) snapshot of its state, timed where this Ray has it
        from ray.tune.execution.tune_controller import TuneController

        original_save = TuneController.save_to_dir

        def timed_save(self):
            started = time.thread_time()
            original_save(self)
            snapshots.append((time.thread_time() - started, len(spent), time.process_time()))

        TuneController.save_to_dir = timed_save
    except (ImportError, AttributeError):
        pass
    sizes = list(range(1, args.trials + 1))
    experiment = {
        "name": "driver_bench",
        "model": str(ROOT / "examples" / "my_model.py") + ":build",
        "model_config": {"features": 8, "width": 16, "depth": 1},
        "device": "cpu",
        "precision": "fp32",
        "steps": 2,
        "warmup_steps": 1,
        "calibrate": False,
        "grid": {"backend": ["deepspeed"], "stage": [0], "micro_batch_size": sizes, "num_workers": [1]},
        "runtime": {"max_concurrent_trials": 2},
    }
    if args.output.exists():
        shutil.rmtree(args.output)
    started = time.time()
    ray_zero.log_to_console()
    results = ray_zero.sweep(experiment, output=args.output, command="python bench/driver_bench.py")
    wall = time.time() - started
    record = [s for _, s in spent]
    first, last = statistics.median(record[:50]), statistics.median(record[-50:])
    per_row = [b - a for a, b in zip(driver_cpu, driver_cpu[1:])]  # the driver's CPU seconds per row

    def cpu_between(start: float, end: float, events=draws) -> float:  # CPU of events ended between two rows
        return sum(cpu for cpu, _, at in events if start < at <= end)

    first_drawing = cpu_between(driver_cpu[0], driver_cpu[50]) / 50
    last_drawing = cpu_between(driver_cpu[-51], driver_cpu[-1]) / 50
    by_50 = [  # each 50 rows: the driver's CPU per row, and the drawing's part of it
        (statistics.mean(per_row[i : i + 50]), cpu_between(driver_cpu[i], driver_cpu[i + 50]) / 50)
        for i in range(0, len(per_row) - 49, 50)
    ]
    rows = map(json.loads, (args.output / "trials.jsonl").open())
    walls = [row["wall_s"] for row in rows if row.get("wall_s")]
    sweep_page = (args.output / "report.html").read_bytes()
    from ray_zero.report.tables import rerender

    rerender(args.output)
    same = sweep_page == (args.output / "report.html").read_bytes()
    summary = {
        "checkout": str(args.checkout),
        "trials": len(record),
        "ok": int((results.table["status"] == "ok").sum()),
        "wall_s": wall,
        "record_first50_median_s": first,
        "record_last50_median_s": last,
        "last_over_first": last / first,
        "record_total_s": sum(record),
        "driver_cpu_first50_mean_s": statistics.mean(per_row[:50]),
        "driver_cpu_last50_mean_s": statistics.mean(per_row[-50:]),
        "driver_cpu_last_over_first": statistics.mean(per_row[-50:]) / statistics.mean(per_row[:50]),
        "drawing_cpu_first50_per_row_s": first_drawing,
        "drawing_cpu_last50_per_row_s": last_drawing,
        "driver_and_drawing_cpu_per_row_by_50": by_50,
        "tune_snapshot_cpu_first50_per_row_s": cpu_between(driver_cpu[0], driver_cpu[50], snapshots) / 50,
        "tune_snapshot_cpu_last50_per_row_s": cpu_between(driver_cpu[-51], driver_cpu[-1], snapshots) / 50,
        "tune_snapshots_rows_and_cpu_s": [[rows, cpu] for cpu, rows, _ in snapshots],
        "drawings": len(draws),
        "last_drawing_rows_and_cpu_s": [draws[-1][1], draws[-1][0]] if draws else None,
        "trial_wall_first50_median_s": statistics.median(walls[:50]),
        "trial_wall_last50_median_s": statistics.median(walls[-50:]),
        "pages_equal_report": same,
    }
    events = {"record_s": spent, "draws": draws, "snapshots": snapshots, "driver_cpu": driver_cpu}
    record_file = {**summary, **events}
    (args.output / "driver_bench.json").write_text(json.dumps(record_file, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
