"""A GPU's profile: what each kernel class reaches at each size, from `python -m ray_zero profile`'s
micro-benchmarks (ray_zero/train/profile_bench.py), never fitted to model runs. Pure: no torch.

The file's `results` are rows of one timed call each: {"kind", "dtype", "shape", "flops", "bytes",
"seconds"} (and "params" for an optimizer step). Files from 2026-12-06 19:00 UTC on time each point
as 5 repeats in each of two passes: "seconds" is the fastest repeat's, and the row adds "median_s",
"iqr_over_median", "max_over_min" (over all its repeats), "repeats", "calls" (a repeat's, by pass) and
"pass_ratio" (the second pass's fastest over the first's); `launch` and `hook` hold the same for
`launch_s` and `hook_s`, and `left_out` the cases the budget left out. Earlier files have one mean a
point and read the same. A kind's rate is read at the size that sets it:
- compute kinds (matmul, attention, conv): FLOP/s, by FLOPs per call;
- memory kinds (elementwise, reduction): bytes/s, by bytes per call;
- optimizer steps (adamw_foreach, adamw_fused): parameters/s, by parameters per step.
Beside them, the host's seconds per launched kernel (`launch_s`) and per module hook (`hook_s`; files of
earlier versions have none: hooks are not counted).
Between measured sizes the rate is log-linear in the size; beyond them, the nearest end's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ray_zero.config import ConfigError
from ray_zero.measure.bandwidth import log_linear, read_command_file

FILE_KIND = "ray_zero gpu profile"
COMPUTE = ("matmul", "attention", "conv")
MEMORY = ("elementwise", "reduction", "random")
"""Kinds whose time is their bytes: random is a random fill (dropout's mask), which a CPU computes far more
slowly per byte than a multiply (a profile without it reads it at elementwise's rate)."""
OPTIMIZERS = ("adamw_foreach", "adamw_fused")
OPTIMIZER = "adamw_foreach"
"""torch.optim.AdamW's default on CUDA (foreach), which every engine here steps (DeepSpeed's torch_adam)."""


def _size(row: dict) -> float:
    kind = row["kind"]
    if kind in COMPUTE:
        return float(row["flops"])
    if kind in OPTIMIZERS:
        return float(row["params"])
    return float(row["bytes"])


def rate_of(row: dict) -> float:
    """A row's achieved rate: FLOP/s, bytes/s or parameters/s (by its kind)."""
    return _size(row) / float(row["seconds"])


@dataclass(frozen=True)
class Profile:
    """Achieved rates by (kind, dtype) and size, and the host's seconds per launched kernel."""

    source: str
    """The file, and the GPU it was measured on."""
    launch_s: float
    curves: dict[tuple[str, str], list[tuple[float, float]]]
    """(kind, dtype) -> [(size per call, rate)], by size."""
    hardware: str = ""
    """The device's name as CUDA gives it (meter.PEAK_TFLOPS's key), or the CPU's."""
    hook_s: Optional[float] = None
    """The host's seconds per call of a module hook (a Python forward hook on a tiny module: the floor of
    an engine's hooks, which do more in them); None: not measured, hooks not counted."""

    def rate(self, kind: str, dtype: str, size: float) -> float:
        """The rate of one call of `kind` at `size`. A dtype not measured for its kind is read at the kind's
        other dtypes (fp32 first); a compute kind not measured at all at matmul's, a memory kind at
        elementwise's."""
        stand_in = "matmul" if kind in COMPUTE else "elementwise" if kind in MEMORY else kind
        for key in ((kind, dtype), *self._others(kind), (stand_in, dtype), *self._others(stand_in)):
            if key in self.curves:
                return log_linear(self.curves[key], size)
        measured = ", ".join(sorted({k for k, _ in self.curves}))
        raise ConfigError(f"{self.source}: no {kind} figures (measured: {measured})")

    def _others(self, kind: str) -> list[tuple[str, str]]:
        return sorted((k for k in self.curves if k[0] == kind), key=lambda k: k[1] != "fp32")


def profile_from(content: dict, source: str) -> Profile:
    """A Profile from a profile file's content (as `profile` writes it)."""
    curves: dict[tuple[str, str], dict[float, list[float]]] = {}
    for row in content.get("results", []):
        # a vocabulary head's matmul (bucket "head") stays out of the square and block shapes' FLOPs curve
        if float(row.get("seconds", 0)) > 0 and row.get("bucket") != "head":
            curves.setdefault((row["kind"], row["dtype"]), {}).setdefault(_size(row), []).append(rate_of(row))
    # shapes of equal size (a tall and a square matmul of the same FLOPs) share one point: their mean
    averaged = {key: sorted((s, sum(r) / len(r)) for s, r in by.items()) for key, by in curves.items()}
    if not averaged or not content.get("launch_s"):
        raise ConfigError(f"{source}: no figures in it (a profile needs results and launch_s)")
    hardware = content.get("hardware", {}).get("name", "?")
    hook_s = float(content["hook_s"]) if content.get("hook_s") else None
    label = f"{source} ({hardware}, {content.get('date', '?')})"
    return Profile(label, float(content["launch_s"]), averaged, hardware, hook_s)


def read_profile(path: Path, label: Optional[str] = None) -> Profile:
    """A `python -m ray_zero profile` file."""
    content = read_command_file(path, "profile", FILE_KIND)
    return profile_from(content, label or str(path))


NOISY = 0.10
"""A point whose repeats' IQR over median is above this is reported as noisy."""


def profile_notes(content: dict) -> list[str]:
    """What a reader of a profile file should know beside its rates: how many points' repeats spread over
    NOISY (and the widest), the host figures' spread, and the cases left out for the budget. Nothing for
    a file of one mean a point."""
    timed = [r for r in content.get("results", []) if "iqr_over_median" in r]
    notes = []
    if timed:
        noisy = [r for r in timed if r["iqr_over_median"] > NOISY]
        widest = max(timed, key=lambda r: r["max_over_min"])
        notes.append(
            f"{len(noisy)} of {len(timed)} points spread over {NOISY:.0%} (IQR/median of "
            f"{widest['repeats']} repeats, the fastest kept); widest: {widest['kind']} {widest['dtype']} "
            f"{widest['shape']}, max/min {widest['max_over_min']:.2f}"
        )
    for name in ("launch", "hook"):
        if isinstance(content.get(name), dict):
            figure = content[name]
            notes.append(
                f"{name}: {figure['seconds'] * 1e6:.3f} us, IQR/median {figure['iqr_over_median']:.0%}, "
                f"max/min {figure['max_over_min']:.2f}"
            )
    left = [
        f"{x['kind']} {x['dtype']} ({x['cases']} after {x['after']})" for x in content.get("left_out", [])
    ]
    if left:
        notes.append("left out for the budget: " + "; ".join(left))
    return notes
