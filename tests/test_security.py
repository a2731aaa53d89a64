"""A private Ray started by ray_zero: dashboard on 127.0.0.1 only, token authentication on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import os, time, psutil, ray
from ray_zero.run.cluster import start_ray
context, joined = start_ray(None)
port = int(context.dashboard_url.rsplit(":", 1)[1])
for _ in range(50):
    ips = {c.laddr.ip for c in psutil.net_connections("inet")
           if c.status == "LISTEN" and c.laddr.port == port}
    if ips:
        break
    time.sleep(0.2)
print("joined", joined)
print("dashboard", sorted(ips))
print("auth", os.environ.get("RAY_AUTH_MODE"))
ray.shutdown()
"""


def test_private_ray_dashboard_is_loopback_only_and_token_auth_stays_on():
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=180, env=env
    )
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines.get("joined") == "None", done.stdout + done.stderr[-2000:]
    assert lines["dashboard"] == "['127.0.0.1']"
    assert lines["auth"] == "token"
