"""Where users run it: a two-node cluster (`ray start --head`, `ray start --address`), README's script
(examples/sweep_script.py, through the Python API) submitted with `ray job submit` and joining it with
`--address auto`, its 2-worker trial SPREAD over both nodes, live metrics on the nodes' Prometheus
endpoints, and the run state in a storage path. One cluster and one job for all of it: each cluster and
each trial costs tens of seconds on the 2-core machine.

The cluster has its own ports and temp dir and is torn down (its processes killed) also when the test fails.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd

import ray_zero

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from local_cluster import _ray, local_cluster  # noqa: E402  (bench/local_cluster.py)


def _zero_metrics(url: str) -> list[str]:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith("ray_zero_")]


def test_submitted_job_joins_a_two_node_cluster_spreads_its_trial_and_exports_live_metrics(tmp_path):
    output, storage = tmp_path / "job", tmp_path / "shared"
    with local_cluster(extra_nodes=1, cpus_per_node=1) as cluster:
        excludes = json.dumps({"excludes": [".whl", "runs", "data", ".git", "results", "bench/results"]})
        # Each node has 1 CPU: the 2-worker trial can only run with one worker per node; 3 workers do not fit.
        sweep = [  # README's command: the script's default experiment is experiments/quick.yaml
            "python",
            "examples/sweep_script.py",
            "--address",
            "auto",
            "--set",
            "steps=50",  # about 5 s of training: gauges exported each second (RAY_metrics_report_interval_ms)
            "--set",
            "grid.stage=[1]",
            "--set",
            "grid.num_workers=[2,3]",
            "--set",
            "runtime.placement_strategy=SPREAD",
            "--set",
            f"runtime.storage_path=file://{storage}",
            "--output",
            str(output),
        ]
        ready_by = time.time() + 60
        while True:  # right after `ray start` the job agent may not be up yet: it says "try again"
            submit = _ray(
                "job",
                "submit",
                f"--address={cluster['dashboard']}",
                "--no-wait",
                "--working-dir",
                ".",
                f"--runtime-env-json={excludes}",
                "--",
                *sweep,
                cwd=ROOT,
            )
            if "No available agent" not in submit.stderr or time.time() > ready_by:
                break
            time.sleep(1)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
        seen: list[str] = []
        status = ""
        deadline = time.time() + 400
        asked_at = 0.0
        while time.time() < deadline:
            for url in cluster["metrics"]:
                seen += [line for line in _zero_metrics(url) if "samples_per_s" in line]
            # Every 5 s: each `ray job status` is a new Python process, about a core-second taken from
            # the 2 CPUs that the job's two workers train on.
            if time.time() - asked_at >= 5:
                asked_at = time.time()
                status = _ray("job", "status", f"--address={cluster['dashboard']}", job_id).stdout.lower()
                if any(s in status for s in ("succeeded", "failed", "stopped")):
                    break
            time.sleep(1)
        logs = _ray("job", "logs", f"--address={cluster['dashboard']}", job_id).stdout
        assert "succeeded" in status, logs[-3000:]
    assert "ray_zero: Ray dashboard at http://127.0.0.1" in logs  # the package's console lines
    assert "stage1_mb64_w2: ok, peak" in logs  # the script's own, from the table the API returned
    results = ray_zero.Results.read(output)
    assert sorted(results.table["trial"]) == ["stage1_mb64_w2", "stage1_mb64_w3"]
    assert {"results.csv", "per_rank.csv", "report.html"} <= set(results.files)
    table = pd.read_csv(output / "results.csv").set_index("num_workers")
    assert table.loc[2, "status"] == "ok" and table.loc[3, "status"] == "skipped"
    assert "has room for 2" in table.loc[3, "error"]
    ranks = pd.read_csv(output / "per_rank.csv")
    assert len(ranks) == 2 and ranks["node_id"].nunique() == 2  # one worker on each node, over gloo
    assert (storage / "tune").is_dir() and (storage / "train").is_dir()  # run state went to the storage path
    assert (storage / "results" / "results.csv").is_file()  # and the tables too
    # Live gauges, tagged per trial and rank, reached a node's Prometheus export during the run.
    assert any(
        'rank="1"' in line and 'stage="1"' in line and 'trial="stage1_mb64_w2"' in line for line in seen
    ), seen[:3]
