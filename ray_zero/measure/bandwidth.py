"""The bus bandwidth a speed prediction divides bytes by: a file of `python -m ray_zero bandwidth`, or one
figure the user gives (`--busbw GB/s`). Pure: no Ray, no torch.

busbw is nccl-tests' figure: a collective of S bytes (its message: an all-reduce's tensor, a
reduce-scatter's whole input, an all-gather's whole output) that took t seconds among N ranks ran at
algbw = S / t, and busbw = algbw x 2(N-1)/N for an all-reduce, x (N-1)/N for a reduce-scatter or an
all-gather, x 1 for a broadcast or a reduce: what each rank's link carried, comparable across N. So a
collective of S bytes at N ranks takes S x factor(N) / busbw.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ray_zero.config import ConfigError

FILE_KIND = "ray_zero bandwidth"
"""The file's `kind` field (a file of something else is refused by name)."""
MEASURED = ("all_reduce", "reduce_scatter", "all_gather")
"""What `bandwidth` measures; a broadcast or a reduce is read at the all-gather's figure (one pass of the
data over each link, as a ring all-gather's)."""
STAND_IN = {"broadcast": "all_gather", "reduce": "all_gather"}
GB = 1e9
"""nccl-tests' GB/s are 10^9 bytes a second."""


def bus_factor(kind: str, workers: int) -> float:
    """nccl-tests' busbw over algbw for a collective of `kind` among `workers` ranks."""
    if workers < 2:
        return 0.0
    if kind == "all_reduce":
        return 2 * (workers - 1) / workers
    if kind in ("reduce_scatter", "all_gather"):
        return (workers - 1) / workers
    return 1.0


@dataclass(frozen=True)
class Bandwidth:
    """busbw (GB/s) by collective and message size; `busbw(kind, nbytes)` reads it off (log-linear between
    measured sizes, the nearest end beyond them)."""

    source: str
    """What the figures are: the file and where it was measured, or the figure given."""
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """kind -> [(message bytes, busbw GB/s)], by size; empty with `constant`."""
    constant: Optional[float] = None

    def busbw(self, kind: str, nbytes: float) -> float:
        if self.constant is not None:
            return self.constant
        curve = self.curves.get(kind) or self.curves.get(STAND_IN.get(kind, ""), [])
        if not curve:
            raise ConfigError(f"{self.source}: no {kind} figures (measured: {', '.join(self.curves)})")
        return log_linear(curve, nbytes)

    def seconds(self, kind: str, nbytes: float, workers: int, message_bytes: Optional[float] = None) -> float:
        """Time of `nbytes` of `kind` among `workers` ranks, sent as messages of `message_bytes` (default:
        one message of them all)."""
        if nbytes <= 0 or workers < 2:
            return 0.0
        rate = self.busbw(kind, message_bytes or nbytes) * GB
        return nbytes * bus_factor(kind, workers) / rate


def log_linear(curve: list[tuple[float, float]], size: float) -> float:
    """A curve of (size, value), by size, read at `size`: log-linear between its points, the nearest end's
    value beyond them."""
    sizes = [s for s, _ in curve]
    if size <= sizes[0]:
        return curve[0][1]
    if size >= sizes[-1]:
        return curve[-1][1]
    i = bisect.bisect_left(sizes, size)
    (s0, b0), (s1, b1) = curve[i - 1], curve[i]
    weight = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return b0 + weight * (b1 - b0)


def given(busbw_gbps: float) -> Bandwidth:
    if not busbw_gbps > 0:
        raise ConfigError(f"--busbw: give the bus bandwidth in GB/s, above 0, not {busbw_gbps}")
    return Bandwidth(f"busbw {busbw_gbps:g} GB/s as given", constant=busbw_gbps)


def read_command_file(path: Path, command: str, kind: str) -> dict:
    """The JSON a `python -m ray_zero COMMAND` wrote (its "kind" says so), given as --COMMAND PATH; one
    ConfigError line where it cannot be read or is another file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"--{command} {path}: cannot read it ({error}); give a file of `python -m ray_zero {command}`"
        ) from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        raise ConfigError(f"--{command} {path}: not a file of `python -m ray_zero {command}`")
    return data


def read_bandwidth(path: Path, label: Optional[str] = None) -> Bandwidth:
    """A `python -m ray_zero bandwidth` file: {"kind": FILE_KIND, "workers", "backend", "where",
    "results": [{"collective", "bytes", "time_s", "algbw_gbps", "busbw_gbps"}, ...], ...}."""
    path = Path(path)
    data = read_command_file(path, "bandwidth", FILE_KIND)
    curves: dict[str, list[tuple[int, float]]] = {}
    for entry in data.get("results", []):
        curves.setdefault(entry["collective"], []).append((int(entry["bytes"]), float(entry["busbw_gbps"])))
    if not curves:
        raise ConfigError(
            f"--bandwidth {path}: no figures in it (it was measured at {data.get('workers')} worker)"
        )
    where = f"{data.get('workers')} workers, {data.get('backend')}, {data.get('where', '?')}"
    return Bandwidth(f"{label or path} ({where})", {k: sorted(v) for k, v in curves.items()})
