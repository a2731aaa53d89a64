"""Where users run it: a two-node cluster (`ray start --head`, `ray start --address`), README's script
(examples/sweep_script.py, through the Python API) submitted with `ray job submit` and joining it with
`--address auto`, its 2-worker trial SPREAD over both nodes, live metrics on the nodes' Prometheus
endpoints, and the run state in a storage path. One cluster and one job for all of it: each cluster and
each trial costs tens of seconds on the 2-core machine.

The cluster has its own ports and temp dir and is torn down (its processes killed) also when the test fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import psutil

import ray_zero

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent)
# The job's `python` is the one on the PATH that `ray start` ran with: put this venv first.
ENV = {
    **os.environ,
    "PATH": f"{BIN}:{os.environ['PATH']}",
    "RAY_AUTH_MODE": "token",
    "RAY_metrics_report_interval_ms": "1000",
    "RAY_USAGE_STATS_ENABLED": "0",
}
ENV.pop("RAY_ADDRESS", None)


def _free_ports(count: int) -> list[int]:
    """Distinct free ports: all sockets stay open until every port is known (else the OS may repeat one)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _agent_ports(ports) -> list[str]:
    """Own ports for the node's dashboard agent, so no earlier cluster's agent can stand in the way."""
    return [
        f"--dashboard-agent-listen-port={next(ports)}",
        f"--dashboard-agent-grpc-port={next(ports)}",
        f"--runtime-env-agent-port={next(ports)}",
    ]


def _ray(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [f"{BIN}/ray", *args], env=ENV, capture_output=True, text=True, timeout=180, **kwargs
    )


@contextmanager
def local_cluster(extra_nodes: int = 0, cpus_per_node: int = 2):
    """`ray start --head` (and `ray start --address` for each extra node); killed on exit."""
    temp = tempfile.mkdtemp(prefix="rz", dir="/tmp")  # short: Ray's socket paths must stay short
    # Each node its own temp dir, as on separate machines: nodes sharing one also share its runtime_resources,
    # and the second node's runtime-env agent deleted the job's working_dir (the driver's cwd) when its
    # workers finished.
    node_temps = [tempfile.mkdtemp(prefix="rz", dir="/tmp") for _ in range(extra_nodes)]
    ports = iter(_free_ports(8 + 4 * extra_nodes))
    port, dashboard, metrics = next(ports), next(ports), [next(ports)]
    try:
        # As docs/clusters.md says: on a machine without a token, `ray start` would leave authentication off.
        generated = _ray("get-auth-token", "--generate")
        assert generated.returncode == 0, generated.stderr
        head = _ray(
            "start",
            "--head",
            f"--port={port}",
            f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1",
            f"--metrics-export-port={metrics[0]}",
            f"--num-cpus={cpus_per_node}",
            f"--temp-dir={temp}",
            f"--ray-client-server-port={next(ports)}",
            *_agent_ports(ports),
            '--resources={"node_head": 1}',
        )
        assert head.returncode == 0, head.stdout + head.stderr
        for index in range(extra_nodes):
            metrics.append(next(ports))
            node = _ray(
                "start",
                f"--address=127.0.0.1:{port}",
                f"--num-cpus={cpus_per_node}",
                f"--temp-dir={node_temps[index]}",
                f"--metrics-export-port={metrics[-1]}",
                *_agent_ports(ports),
                f'--resources={{"node_{index}": 1}}',
            )
            assert node.returncode == 0, node.stdout + node.stderr
        yield {
            "address": f"127.0.0.1:{port}",
            "dashboard": f"http://127.0.0.1:{dashboard}",
            "metrics": [f"http://127.0.0.1:{m}/metrics" for m in metrics],
        }
    finally:
        # Not `ray stop`: that would stop every Ray on the machine, the test session's own too. This
        # cluster's processes name its temp dir or its GCS port; their children go with them.
        marks = (temp, *node_temps, f":{port}")
        mine = {
            p
            for p in psutil.process_iter(["cmdline"])
            if any(m in a for a in p.info["cmdline"] or [] for m in marks)
        }
        for process in list(mine):
            try:
                mine.update(process.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        for process in mine:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(list(mine), timeout=30)
        for folder in (temp, *node_temps):  # their logs and sockets: a few MB per cluster, kept otherwise
            shutil.rmtree(folder, ignore_errors=True)


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
