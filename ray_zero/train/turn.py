"""A GPU's measurement turn: trials that share a GPU build their models and engines side by side, but
their warm-up and timed steps take turns, so that each trial's samples/s is its own.

The turn is an exclusive lock (flock) on a file named after the GPU's UUID, in a folder on the GPU's
node: every process that trains on that GPU, of this sweep or of another, queues on the same file. The
kernel lets go of a lock whose process dies (a SIGKILL, an out-of-memory kill): no turn outlives its
holder. No Ray here: the rank takes the turn the same way under Ray Train, torchrun or a test.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

TURN_DIR_ENV = "RAY_ZERO_TURN_DIR"
"""Where the lock files live (default: the system's temporary folder, ray_zero-turns)."""


def turn_dir() -> Path:
    return Path(os.environ.get(TURN_DIR_ENV) or Path(tempfile.gettempdir()) / "ray_zero-turns")


class MeasurementTurn:
    """The turn of one device (`key`, e.g. a GPU's UUID): `acquire()` waits for it, `release()` hands it
    on; the seconds waited are in `waited_s`."""

    def __init__(self, key: str, folder: Optional[Path] = None):
        self.key = key
        self.path = (folder or turn_dir()) / f"{key}.lock"
        self._fd: Optional[int] = None
        self.waited_s = 0.0

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # every user on the node queues on the same file
            os.chmod(self.path.parent, 0o1777)
        except OSError:
            pass
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        started = time.perf_counter()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.waited_s = time.perf_counter() - started

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "MeasurementTurn":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def gpu_turn(device: torch.device) -> Optional[MeasurementTurn]:
    """The turn of the GPU `device` is; None on CPU (CPU trials do not share a device: the plan gives
    each worker its own CPUs)."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return MeasurementTurn(f"gpu-{uuid}")
