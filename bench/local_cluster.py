"""A Ray cluster of several nodes on this machine (`ray start --head`, `ray start --address` per node),
each with its own ports and temp dir, killed on exit: the suite's cluster test and bench/chaos.py use it.
`stop_node` / `start_node` lose and bring back a worker node (its raylet and its workers killed)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import psutil

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
            "temp": temp,
            "node_temps": node_temps,
            "cpus_per_node": cpus_per_node,
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


def _processes_of(*marks: str) -> list[psutil.Process]:
    """The processes naming one of `marks` in their command line, and all their descendants (a Ray
    worker renames itself, `ray::...`, and names no temp dir: it is found as its raylet's child)."""
    found = {
        p
        for p in psutil.process_iter(["cmdline"])
        if any(m in a for a in p.info["cmdline"] or [] for m in marks)
    }
    for process in list(found):
        try:
            found.update(process.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return list(found)


def cluster_processes(cluster: dict) -> list[psutil.Process]:
    """Every process of this cluster (head and worker nodes), none of another Ray on the machine."""
    return _processes_of(cluster["temp"], *cluster["node_temps"])


def stop_node(cluster: dict, index: int) -> int:
    """Kill worker node `index` (its raylet, agents and workers: every process naming its temp dir, and
    their children), as a machine lost would; the processes killed."""
    victims = _processes_of(cluster["node_temps"][index])
    for process in victims:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)
    return len(victims)


def start_node(cluster: dict, index: int) -> bool:
    """Worker node `index` back (a new raylet on its temp dir, new ports)."""
    ports = iter(_free_ports(4))
    node = _ray(
        "start",
        f"--address={cluster['address']}",
        f"--num-cpus={cluster['cpus_per_node']}",
        f"--temp-dir={cluster['node_temps'][index]}",
        f"--metrics-export-port={next(ports)}",
        *_agent_ports(ports),
        f'--resources={{"node_{index}": 1}}',
    )
    return node.returncode == 0
