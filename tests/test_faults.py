"""Faults become rows: an out-of-memory rank, a killed worker (retried, then failed), an interrupted
sweep that is resumed. Real Ray, real DeepSpeed, real processes killed with SIGKILL and SIGINT."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import psutil

from ray_zero.experiment_file import load_experiment
from ray_zero.store import load_trials
from ray_zero.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[1]


def _quick(*overrides: str):
    return load_experiment(ROOT / "experiments" / "quick.yaml", ["steps=4", "warmup_steps=1", *overrides])


def test_out_of_memory_is_a_row_and_the_sweep_goes_on(ray_instance, tmp_path):
    # The injected error is torch.cuda.OutOfMemoryError, the type the production path catches on GPUs.
    experiment = _quick("grid.num_workers=[2]", "fault={kind: oom, step: 2, rank: 1, stage: 1}")
    frame = run_sweep(experiment, tmp_path, command="pytest oom").set_index("stage")
    assert frame.loc[0, "status"] == "ok"
    oom = frame.loc[1]
    assert oom["status"] == "oom" and oom["num_workers"] == 2 and oom["micro_batch_size"] == 64
    assert "rank 1 out of memory during step 2" in oom["error"]
    assert oom["peak_allocated_gib_max"] > 0.1  # the memory at the failure
    saved = pd.read_csv(tmp_path / "results.csv")
    assert sorted(saved["status"]) == ["ok", "oom"]


def test_killed_worker_is_retried_then_recorded_as_failed(ray_instance, tmp_path):
    # Stage 0's worker kills itself with SIGKILL at step 2 on every attempt; stage 1 is healthy.
    experiment = _quick("grid.num_workers=[1]", "runtime.max_failures=1", "fault={kind: sigkill, step: 2, stage: 0}")
    frame = run_sweep(experiment, tmp_path, command="pytest sigkill").set_index("stage")
    failed, healthy = frame.loc[0], frame.loc[1]
    assert failed["status"] == "failed" and failed["attempts"] == 2  # first try + max_failures retries
    assert "worker process has died" in failed["error"]
    assert healthy["status"] == "ok" and healthy["attempts"] == 1


def _placed_worker_groups() -> list[str]:
    """Placement groups that hold CPUs now (a Ray Train worker group's; Tune's trial holds only memory)."""
    from ray.util.placement_group import placement_group_table

    return [pg_id for pg_id, pg in placement_group_table().items()
            if pg["state"] == "CREATED" and any("CPU" in bundle for bundle in pg["bundles"].values())]


def _train_workers() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "RayTrainWorker" in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


def test_worker_killed_from_outside_as_it_starts_is_retried(ray_instance, tmp_path):
    # Killed as soon as its process appears, while Ray Train starts the worker group (actor, train
    # context, process group): Ray Train kept that group's placement group, and the retry waited for its
    # CPU for ever; and a failed start was not counted as an attempt.
    experiment = _quick("steps=20", "warmup_steps=2", "grid.stage=[1]", "grid.num_workers=[1]", "runtime.max_failures=1")
    result: dict = {}
    sweep = threading.Thread(target=lambda: result.update(frame=run_sweep(experiment, tmp_path, command="pytest kill")),
                             daemon=True)
    sweep.start()
    victim = None
    deadline = time.time() + 120
    while victim is None and time.time() < deadline:
        workers = _train_workers()
        victim = workers[0] if workers else None
        time.sleep(0.05)
    assert victim is not None, "no Ray Train worker process appeared"
    victim.send_signal(signal.SIGKILL)
    retried = None
    deadline = time.time() + 240
    while retried is None and sweep.is_alive() and time.time() < deadline:
        retried = next((w for w in _train_workers() if w.pid != victim.pid), None)
        time.sleep(0.05)
    # The retried group's workers exist, so its placement group is placed: the failed one's is gone.
    assert retried is not None, "no worker of a retried group appeared within 240 s of the kill"
    assert len(_placed_worker_groups()) == 1
    sweep.join(timeout=240)
    assert not sweep.is_alive(), "the sweep did not end within 240 s of the kill"
    row = result["frame"].iloc[0]
    # The killed worker died before its training function began: Ray Train retried the group start (and,
    # with its own controller actor, released the failed group's CPU: one group placed above). Only
    # attempts whose ranks began training are counted.
    assert row["status"] == "ok" and row["attempts"] >= 1
    # The report came from the retried worker (trials.jsonl keeps each rank's pid; per_rank.csv does not).
    ranks = [rank for record in load_trials(tmp_path) for rank in record["per_rank"]]
    assert ranks and victim.pid not in {rank["pid"] for rank in ranks}


def test_interrupted_sweep_resumes_running_only_unfinished_trials(tmp_path):
    output = tmp_path / "sweep"
    # One trial at a time (each worker takes both CPUs), so "after the first trial" is well defined; the
    # next one starts early and waits for the CPUs, so Ctrl-C also stops a trial that is only waiting.
    args = [sys.executable, "-m", "ray_zero", "sweep", "experiments/quick.yaml", "--output", str(output),
            "--set", "steps=4", "--set", "grid.stage=[0,1]", "--set", "grid.num_workers=[1]",
            "--set", "runtime.cpus_per_worker=2", "--set", "runtime.overlap_startup=true"]
    sweep = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    record = output / "trials.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (record.is_file() and record.read_text().count("\n") >= 1):
        time.sleep(0.5)
    sweep.send_signal(signal.SIGINT)  # Ctrl-C
    out, _ = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, out
    assert f"sweep --resume {output}" in out
    first = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(first) == 1

    resumed = subprocess.run([sys.executable, "-m", "ray_zero", "sweep", "--resume", str(output)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    table = pd.read_csv(output / "results.csv")
    assert sorted(table["trial"]) == ["stage0_mb64_w1", "stage1_mb64_w1"]
    assert (table["status"] == "ok").all()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 2  # every trial exactly once: the finished ones were not run again
    assert lines[0] == first[0]
