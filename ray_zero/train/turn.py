"""A GPU's measurement turn: trials that share a GPU build their models and engines side by side, but
their warm-up and timed steps take turns, and no trial sets up (builds its model, initialises its
engine) while another measures, so that each trial's samples/s is its own.

Three locks (flock) on files named after the GPU's UUID, in a folder on the GPU's node, that every
process training on that GPU, of this sweep or of another, uses:
- a trial sets up holding `.setup` shared (set-ups run side by side), and measures holding `.turn`
  exclusive, then `.setup` exclusive (it waits for the set-ups under way; later ones wait for it): a
  set-up beside a measuring trial slows it (bench/sweep_bench.md);
- between its set-up and its turn a trial holds `.ready` shared, and a trial starts to set up only with
  `.ready` exclusive: while set-up trials wait for their turns, a trial that comes (when an earlier one
  ends and frees its share) waits too, and those that came set up together once the last has measured,
  in one gap between turns rather than one gap per trial.
The kernel lets go of a lock whose process dies (a SIGKILL, an out-of-memory kill): no turn outlives its
holder. No Ray here: the rank takes the turn the same way under Ray Train, torchrun or a test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

TURN_WAIT = "waiting for the GPU's turn"
"""A rank's phase while it waits (a trial's bound does not count it: ray_zero/run/trial_log.py)."""
TURN_DIR_ENV = "RAY_ZERO_TURN_DIR"
"""Where the lock files live (default: the system's temporary folder, ray_zero-turns)."""


def turn_dir() -> Path:
    return Path(os.environ.get(TURN_DIR_ENV) or Path(tempfile.gettempdir()) / "ray_zero-turns")


class MeasurementTurn:
    """The turn of one device (`key`, e.g. a GPU's UUID): `setting_up()` around a trial's set-up (it
    waits while set-up trials wait for their turns, or one measures), `acquire()` waits for the turn (and
    for set-ups under way), `release()` hands it on; the seconds waited, before the set-up and for the
    turn that follows it, are in `waited_s`."""

    def __init__(self, key: str, folder: Optional[Path] = None):
        self.key = key
        self.folder = folder or turn_dir()
        self.path = self.folder / f"{key}.turn"
        self._held: dict[str, int] = {}
        self.waited_s = 0.0

    def _lock(self, suffix: str, kind: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        try:  # every user on the node queues on the same files
            os.chmod(self.folder, 0o1777)
        except OSError:
            pass
        fd = os.open(self.folder / f"{self.key}.{suffix}", os.O_RDWR | os.O_CREAT, 0o666)
        started = time.perf_counter()
        fcntl.flock(fd, kind)
        self.waited_s += time.perf_counter() - started
        self._held[suffix] = fd

    def _unlock(self, suffix: str) -> None:
        fd = self._held.pop(suffix)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _unlock_all(self) -> None:
        for suffix in reversed(list(self._held)):  # the last taken first
            self._unlock(suffix)

    @contextlib.contextmanager
    def setting_up(self, after_waiting: bool = True) -> Iterator[None]:
        """Around a trial's set-up: beside other set-ups, never while a trial measures, nor (with
        `after_waiting`) while set-up trials wait for their turns. Once set up, the trial is one of those
        waiting (until `acquire`). A trial with ranks on other devices sets up without `after_waiting`:
        its ranks meet in the engine's set-up, and one must not wait there for another GPU's queue."""
        self.waited_s = 0.0
        try:
            if after_waiting:
                self._lock("ready", fcntl.LOCK_EX)
            self._lock("setup", fcntl.LOCK_SH)
            if after_waiting:
                self._unlock("ready")
            yield
            self._lock("ready", fcntl.LOCK_SH)
            self._unlock("setup")
        except BaseException:
            self._unlock_all()
            raise

    def acquire(self) -> None:
        if "ready" not in self._held:  # not straight after `setting_up`: a wait of its own
            self.waited_s = 0.0
        self._lock("turn", fcntl.LOCK_EX)
        self._lock("setup", fcntl.LOCK_EX)
        if "ready" in self._held:
            self._unlock("ready")

    def release(self) -> None:
        self._unlock_all()

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
