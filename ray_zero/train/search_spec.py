"""One search of `fit` as its ranks get it (SearchSpec): its point, budget and steps, the probes an earlier
run measured, and its first guess from the memory model, its error band and its engine's correction; and
the calibration probes it may start with. Pure: the probes run in train/probing.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ray_zero.config import Experiment, TrialSpec
from ray_zero.measure import calibration, error_band
from ray_zero.measure.correction import Correction
from ray_zero.measure.memory_model import predict_point
from ray_zero.measure.prediction import GIB
from ray_zero.measure.search import TARGETS, BracketSearch, Steps, largest_predicted_to_fit
from ray_zero.rows import trial_row


@dataclass(frozen=True)
class RecordedProbe:
    """A probe the search has already measured (in an earlier run of the same search)."""

    micro_batch_size: int
    """The value probed: a micro-batch, or a seq_len with fit --target seq_len."""
    status: str
    peak_gib: Optional[float]
    per_sample_gib: Optional[float] = None
    error: str = ""


@dataclass(frozen=True)
class SearchSpec:
    """One search of `fit`, as its ranks get it."""

    spec: TrialSpec
    """The search's point (its searched field a placeholder) with the probes' short experiment."""
    budget_gib: float
    steps: Steps
    timed: Optional[Experiment] = None
    """The experiment to time the answer with (None: the probes' own rates serve)."""
    calibrate: bool = False
    """Run the search's own calibration probes first (their activations per sample give the first guess)."""
    done: tuple[RecordedProbe, ...] = ()
    """Probes of an earlier run of this search, in order."""
    calibration: Optional[dict] = None
    """An earlier run's calibration figures (`calibration.per_sample_bytes`; {}: measured, nothing found),
    so that they are not measured again; None: not measured yet."""
    target: str = "micro_batch"
    """What the search varies (measure.search.TARGETS): micro_batch, or seq_len at the point's micro-batch."""
    predicted_peaks: tuple[tuple[int, float], ...] = ()
    """target seq_len on a GPU: the peaks (GiB) the driver predicted from steps traced at each length it
    tried (a length's step is its own trace, which the ranks do not make)."""
    correction: Optional[Correction] = None
    """Its engine's miss, seen before the search's first probe (ray_zero/measure/correction.py): the
    first guess takes the term that trial measured. micro_batch searches only: a seq_len search's peaks
    are traced before it starts, at the lengths its band's guess needs."""

    @property
    def field(self) -> str:
        return TARGETS[self.target]

    @property
    def name(self) -> str:
        """The search's point without its searched value: stage1_w1, fsdp_stage3_w2_ac (stage1_mb4_w1)."""
        point = self.spec.point
        searched = f"_s{point.seq_len}" if self.target == "seq_len" else f"_mb{point.micro_batch_size}"
        return point.name.replace(searched, "")

    def at(self, value: int, experiment: Optional[Experiment] = None, label: str = "") -> TrialSpec:
        """The spec of a probe at `value` (a micro-batch, or a seq_len)."""
        point = self.spec.point.replace(**{self.field: value})
        return dataclasses.replace(
            self.spec, point=point, experiment=experiment or self.spec.experiment, label=label
        )

    def search(self) -> BracketSearch:
        """The search with the probes already done and its first guess."""
        found = BracketSearch(self.budget_gib, self.steps, self.first_guess(), self.predicted_peak)
        for probe in self.done:
            found.record(
                probe.micro_batch_size, probe.status, probe.peak_gib, probe.per_sample_gib, probe.error
            )
        return found

    def needs_calibration(self) -> bool:
        return self.calibrate and self.calibration is None

    def predicted_peak(self, value: int) -> Optional[float]:
        """The memory model's peak (GiB) at `value` on a GPU: the point's traced step, else this search's
        calibration, else the presets' shapes; None where it predicts none (CPU, or unknown). A seq_len:
        the driver's prediction at that length, where it made one."""
        if not self.spec.use_gpu:
            return None
        if self.target == "seq_len":
            return dict(self.predicted_peaks).get(value)
        calibrated = (
            {"bytes_per_sample": self.calibration, "seq_len": self.spec.point.seq_len}
            if self.calibration
            else None
        )
        peak = predict_point(trial_row(self.at(value)), calibrated).peak_bytes
        return None if peak is None else peak / GIB

    def first_guess(self) -> Optional[int]:
        """Where the memory model puts the answer: the largest size whose predicted peak at its error
        band's upper end (ray_zero/measure/error_band.py), or with its engine's measured excess where that
        is higher, is within the budget; None: the search starts at the smallest size."""
        if not self.spec.use_gpu:
            return None
        band = error_band.band_for(error_band.class_of_info(self.spec.model))

        def high(value: int) -> Optional[float]:
            peak = self.predicted_peak(value)
            if peak is None:
                return None
            return max(band.high_gib(peak), self.correction.peak_gib(peak) if self.correction else peak)

        return largest_predicted_to_fit(high, self.budget_gib, self.steps)


def calibration_probes(search: SearchSpec) -> list[TrialSpec]:
    """The search's calibration probes at its own point: the sizes and length a sweep's calibration
    takes (ray_zero/measure/calibration.py, which reads their rows with `per_sample_bytes`)."""
    spec = search.spec
    length = calibration.probe_experiment(spec.experiment)
    return [
        search.at(size, length, label="calibration")
        for size in calibration.calibration_sizes(spec.model, spec.precision, spec.use_gpu)
    ]
