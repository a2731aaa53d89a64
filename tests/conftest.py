"""Fixtures of the two test levels (tests/README.md): `ranks`, the rank-level harness (a rank's function
under torch.distributed, no Ray), and `ray_instance` / `cli` for the tests whose subject is Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ranks():
    """`ranks(2).row(spec)`: groups of 1 or 2 ranks under gloo, started once for the session
    (tests/rank_group.py)."""
    from rank_group import RankGroups

    groups = RankGroups()
    yield groups
    groups.stop()


@pytest.fixture(scope="session")
def ray_instance():
    """A local Ray shared by every in-process sweep of the session (run_sweep reuses it)."""
    import ray

    # As ray_zero does on a Ray it starts itself (trial.py): no preemption-watcher actor per trial on a
    # single-node Ray, whose node cannot be preempted from under it (about 10 % of a 1-worker trial here).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _run_cli(*args: str, cwd: Path = ROOT, timeout: float = 120, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "ray_zero", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def cli():
    """`cli("sweep", ...)`: run `python -m ray_zero ...` in a fresh process, as a user would."""
    return _run_cli
