"""ray_zero in a user's own stack, through Ray (tests/README.md's Ray level): a sweep run from a script
leaves the script's process environment as it found it and hands each row to Ray Tune's TensorBoard and
MLflow loggers (read back with their own formats and client); a trial whose worker hangs before its
training function ends as a `timeout` row with the worker's stacks, within its bound + 30 s."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from conftest import ROOT

from ray_zero.run.watchdog import TRIAL_KEY_VAR, TRIAL_LOG_VAR
from ray_zero.store import load_trials

SCRIPT = """
import json, os, sys
import ray_zero

before = dict(os.environ)
ray_zero.sweep("experiments/quick.yaml", output=sys.argv[1], overrides=[
    "grid.stage=[1]", "grid.num_workers=[1]", "steps=4", "warmup_steps=1",
    "runtime.loggers=[tensorboard, mlflow]",
])
after = dict(os.environ)
print(json.dumps({k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()
                  if before.get(k) != after.get(k)}))
"""


def tensorboard_scalars(path) -> dict[str, float]:
    """The scalars of one TensorBoard event file (TFRecord framing, tensorboardX's own Event proto)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars, data = {}, path.read_bytes()
    while data:
        (length,) = struct.unpack("<Q", data[:8])
        event = Event.FromString(data[12 : 12 + length])
        data = data[12 + length + 4 :]
        scalars.update({v.tag: v.simple_value for v in event.summary.value})
    return scalars


def test_a_sweep_from_a_script_leaves_its_environment_and_feeds_tensorboard_and_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    out = tmp_path / "quick"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    script = tmp_path / "sweep_script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    changed = json.loads(done.stdout.strip().splitlines()[-1])
    assert changed == {}, changed  # RAY_AUTH_MODE, RAY_AIR_NEW_OUTPUT, MLFLOW_*, RAY_TRAIN_*: as found

    rows = pd.read_csv(out / "results.csv").set_index("trial")
    assert list(rows["status"]) == ["ok"]
    where = json.loads((out / "loggers.json").read_text())
    page = (out / "report.html").read_text()
    assert where["mlflow"]["tracking_uri"] in page and where["tensorboard"]["logdir"] in page

    # TensorBoard: each trial's event file holds its row's numbers.
    events = sorted((out / "tune").glob("*/events.out.tfevents.*"))
    assert len(events) == len(rows)
    scalars = tensorboard_scalars(events[0])
    row = rows.iloc[0]
    assert scalars["ray/tune/peak_allocated_gib_max"] == pytest.approx(
        row["peak_allocated_gib_max"], rel=1e-6
    )
    assert scalars["ray/tune/samples_per_s"] == pytest.approx(row["samples_per_s"], rel=1e-6)

    # MLflow: a run per trial, its metrics the row's, its parameters the point's (not the trial's spec).
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when told
    client = mlflow.MlflowClient(where["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(where["mlflow"]["experiment"])
    runs = {run.data.params["trial"]: run for run in client.search_runs([experiment.experiment_id])}
    assert set(runs) == set(rows.index)
    for trial, run in runs.items():
        assert run.info.status == "FINISHED"
        metrics = run.data.metrics
        assert metrics["peak_allocated_gib_max"] == pytest.approx(rows.loc[trial, "peak_allocated_gib_max"])
        assert metrics["samples_per_s"] == pytest.approx(rows.loc[trial, "samples_per_s"])
        assert run.data.params["stage"] == "1" and run.data.params["backend"] == "deepspeed"


BOUND_S = 8.0
"""Short: the worker is stopped as soon as it is registered, so no healthy stage races the bound."""


def stop_the_first_train_worker(trial_log: str, stopped: list, until: float) -> None:
    """SIGSTOP this sweep's first Ray Train worker process (its environment names the sweep's trial log) once
    it is in the trial log (its `.started` file beside its stack file): it hangs before its training
    function, in Ray Train's own start-up of the worker group. Other sweeps' workers are left alone."""
    folder = Path(tempfile.gettempdir()) / "ray_zero-stacks"
    while time.time() < until and not stopped:
        for process in psutil.process_iter(["pid"]):
            try:
                mine = process.environ().get(TRIAL_LOG_VAR) == trial_log
                key = process.environ().get(TRIAL_KEY_VAR)
            except (psutil.Error, OSError):
                continue
            if mine and (folder / f"{key}-rank_pid{process.pid}.started").is_file():
                os.kill(process.pid, signal.SIGSTOP)
                stopped.append(process.pid)
                return
        time.sleep(0.02)


def test_a_worker_that_hangs_before_its_training_function_is_a_timeout_row_within_its_bound(cli, tmp_path):
    # Through the CLI: the worker-start bound needs the setup hook of a Ray the sweep starts itself.
    out = tmp_path / "hang"
    trial_log = "ray_zero_log_" + hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]  # Session's
    stopped: list[int] = []
    blocker = threading.Thread(
        target=stop_the_first_train_worker, args=(trial_log, stopped, time.time() + 300)
    )
    blocker.start()
    try:
        overrides = ["grid.stage=[1]", "grid.num_workers=[1]", "steps=4", "warmup_steps=1"]
        args = [arg for o in [*overrides, f"runtime.trial_timeout_s={BOUND_S}"] for arg in ("--set", o)]
        done = cli("sweep", "experiments/quick.yaml", *args, "--output", str(out), timeout=300)
    finally:
        blocker.join()
        for pid in stopped:  # never left stopped, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert stopped, f"no Ray Train worker process of this sweep was seen: {done.stderr[-2000:]}"
    record = load_trials(out)[0]
    assert record["status"] == "timeout", record["error"]
    phase = f"worker pid {stopped[0]} (no rank yet): worker started, before its training function"
    assert phase in record["error"] and done.returncode == 1  # the CLI says a row is not ok
    # The bound counts from the worker process's start (ranks_started_at, no rank having started).
    assert record["fit_finished_at"] - record["ranks_started_at"] < BOUND_S + 30, record
    stacks = {who: (out / name).read_text() for who, name in record["stacks"].items()}
    assert set(stacks) == {f"_pid{stopped[0]}"} and "Thread" in stacks[f"_pid{stopped[0]}"], stacks
