"""A run that corrects itself: when a trial's measured peak lies above its prediction's error band (an ok
GPU row whose `inside_band` is false and whose measured/predicted exceeds 1), the trials of the same
engine (backend and activation checkpointing) that start after it are planned with the activation term
that trial measured in place of the traced one: a sweep's GPU shares (ray_zero/run/gpu_sharing.py) and
the first guess of fit's searches (ray_zero/train/probing.py). Pure: no Ray, no torch.

The measured term: the row's measured peak less the prediction's other terms (model states, buckets,
workspaces, data, counted from shapes), over its predicted activation term. A later point takes its own
predicted activation term times that scale; a row that predicted no activations scales its whole peak by
the missed row's measured/predicted. Of several misses of one engine, the largest scale holds. A miss
below the band changes nothing: the plan is on the safe side already. Rows planned with a correction say
so (`corrected_from`, `corrected_peak_gib`); their predicted peak stays the model's own.
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
    scale: Optional[float]
    """Its measured activation term over the predicted one (None: it predicted no activations)."""
    band: str

    def peak(self, peak: float, activation: Optional[float]) -> float:
        """A point's predicted peak with this correction (in the unit given: GiB or bytes): its activation
        term scaled, or (no activation term on either side) its whole peak by the missed row's ratio."""
        if self.scale is not None and activation:
            return peak + (self.scale - 1) * activation
        return peak * self.ratio

    def __str__(self) -> str:
        term = f"activations x{self.scale:.3f}" if self.scale is not None else f"peak x{self.ratio:.3f}"
        return f"{self.trial} measured {self.ratio:.3f}x its prediction, above its band {self.band}: {term}"


def from_row(row: dict[str, Any]) -> Optional[Correction]:
    """The correction an ok GPU row asks for (rows.finish_row made its band fields), or None: inside its
    band, below it, or not comparable."""
    ratio, peak = row.get("measured_over_predicted"), row.get("predicted_peak_gib")
    if row.get("inside_band") is not False or not ratio or ratio <= 1 or not peak:
        return None
    activation = row.get("predicted_activation_gib")
    scale = None
    if activation:
        measured_activation = row["peak_allocated_gib_max"] - (peak - activation)
        scale = measured_activation / activation
    return Correction(str(row["trial"]), engine_of(row), ratio, scale, str(row.get("predicted_band") or ""))


def _larger(a: Correction, b: Correction) -> Correction:
    if a.scale is not None and b.scale is not None:
        return a if a.scale >= b.scale else b
    return a if a.ratio >= b.ratio else b


class Corrections:
    """The misses seen so far, the largest per engine."""

    def __init__(self, found: Optional[dict[tuple[str, bool], Correction]] = None):
        self.by_engine: dict[tuple[str, bool], Correction] = dict(found or {})

    def add(self, correction: Optional[Correction]) -> None:
        if correction is None:
            return
        known = self.by_engine.get(correction.engine)
        self.by_engine[correction.engine] = correction if known is None else _larger(known, correction)

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
        "corrected_peak_gib": correction.peak(peak, row.get("predicted_activation_gib")),
    }
