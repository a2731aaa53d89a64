"""A rank's live figures reach the caller at most once a second, however often it measures a window;
and the rank trains the same way without Ray (the bare-DeepSpeed baseline runs this very `train`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

# One CPU rank in a fresh process (torch.distributed stays out of pytest's), real DeepSpeed, synthetic data:
# a window every step, progress calls recorded with the time they came.
SCRIPT = """
import json, os, socket, time
import torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
from ray_zero.config import Point, TrialSpec
from ray_zero.experiment_file import validate_experiment
from ray_zero.models import describe_model
from ray_zero.worker import train
experiment = validate_experiment({"model": "seed", "dataset": "synthetic", "steps": 160, "warmup_steps": 10,
                                  "runtime": {"live_metrics_every": 1}})
spec = TrialSpec(experiment, Point("deepspeed", 1, 64, 1), "fp32", False, describe_model("seed"), "/tmp")
calls = []
result = train(spec, 0, 1, torch.device("cpu"),
               on_progress=lambda step, values: calls.append([time.perf_counter(), step, values["samples_per_s"]]))
print(json.dumps({"calls": calls, "timed_s": result["timed_s"], "steps": result["steps"]}))
os._exit(0)
"""


def test_live_figures_come_at_most_once_a_second():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    calls = out["calls"]
    assert out["timed_s"] > 2.0, out  # long enough for several publishes at 1 a second
    assert 2 <= len(calls) <= out["timed_s"] + 1, (len(calls), out["timed_s"])  # not one per window (150)
    gaps = [b[0] - a[0] for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= 1.0, gaps
    assert all(rate > 0 for _, _, rate in calls)
