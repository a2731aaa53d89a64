"""A run that corrects itself: when a trial's measured peak lies above its prediction's error band (an ok
GPU row whose `inside_band` is false and whose measured/predicted exceeds 1), the trials of the same
engine (backend and activation checkpointing) that start after it are planned with what that trial
measured beyond its prediction: a sweep's GPU shares (ray_zero/run/gpu_sharing.py) and the first guess of
fit's micro-batch searches (ray_zero/train/probing.py). Pure: no Ray, no torch.

The measured term is the excess, the measured peak less the predicted one, added to each later point's
predicted peak whatever its micro-batch: the misses of the committed sweeps were constant across
micro-batches (DDP's gradient buckets, rebuilt at its second step), and scaling the activation term
instead planned 16 of 17 later rows too high (bench/self_correction.md). Of several misses of one engine,
the largest excess holds. A miss below the band changes nothing: the plan is on the safe side already.
Rows planned with a correction say so (`corrected_from`, `corrected_peak_gib`); their predicted peak stays
the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


def engine_of(row: dict[str, Any]) -> tuple[str, bool]:
    """The engine a correction carries over within: (backend, activation checkpointing)."""
    return str(row.get("backend") or "deepspeed"), bool(row.get("activation_checkpointing"))


@dataclass(frozen=True)
class Correction:
    """What one trial's miss says about the other trials of its engine."""

    trial: str
    engine: tuple[str, bool]
    ratio: float
    """The missed row's measured peak over its predicted peak."""
    excess_gib: float
    """Its measured peak less its predicted peak."""
    band: str

    def peak_gib(self, peak_gib: float) -> float:
        """A point's predicted peak with this correction."""
        return peak_gib + self.excess_gib

    def peak_bytes(self, peak_bytes: float) -> float:
        return peak_bytes + self.excess_gib * 2**30

    def __str__(self) -> str:
        return (
            f"{self.trial} measured {self.ratio:.3f}x its prediction, above its band {self.band}: "
            f"+{self.excess_gib:.2f} GiB"
        )


def from_row(row: dict[str, Any]) -> Optional[Correction]:
    """The correction an ok GPU row asks for (rows.finish_row made its band fields), or None: inside its
    band, below it, or not comparable."""
    ratio, peak = row.get("measured_over_predicted"), row.get("predicted_peak_gib")
    if row.get("inside_band") is not False or not ratio or ratio <= 1 or not peak:
        return None
    excess = row["peak_allocated_gib_max"] - peak
    return Correction(str(row["trial"]), engine_of(row), ratio, excess, str(row.get("predicted_band") or ""))


class Corrections:
    """The misses seen so far, the largest per engine."""

    def __init__(self, found: Optional[dict[tuple[str, bool], Correction]] = None):
        self.by_engine: dict[tuple[str, bool], Correction] = dict(found or {})

    def add(self, correction: Optional[Correction]) -> None:
        if correction is None:
            return
        known = self.by_engine.get(correction.engine)
        if known is None or correction.excess_gib > known.excess_gib:
            self.by_engine[correction.engine] = correction

    def add_row(self, row: dict[str, Any]) -> Optional[Correction]:
        """The row's correction (from_row), kept; None if it asks for none."""
        found = from_row(row)
        self.add(found)
        return found

    def for_row(self, row: dict[str, Any]) -> Optional[Correction]:
        """The correction that applies to a row of a point not yet run (its engine's), if any."""
        return self.by_engine.get(engine_of(row))


def corrected_fields(row: dict[str, Any], correction: Optional[Correction]) -> dict[str, Any]:
    """A trial row's fields that say it was planned with `correction` (nothing where none applies)."""
    peak = row.get("predicted_peak_gib")
    if correction is None or peak is None or correction.engine != engine_of(row):
        return {}
    return {
        "corrected_from": str(correction),
        "corrected_peak_gib": correction.peak_gib(peak),
    }
