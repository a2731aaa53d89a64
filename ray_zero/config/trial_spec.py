"""TrialSpec: everything one trial needs, typed, carried from the sweep to its driver and every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ray_zero.config.experiment import Experiment
from ray_zero.config.points import Point

if TYPE_CHECKING:
    from ray_zero.models.describe import ModelInfo


@dataclass(frozen=True)
class TrialSpec:
    """Everything one trial needs, typed, from the sweep to its driver and every rank."""

    experiment: Experiment
    point: Point
    precision: str
    use_gpu: bool
    model: "ModelInfo"
    """What the driver learnt of the model before Ray started (ray_zero.models.ModelInfo)."""
    storage_path: str
    diagnostics: bool = False
    """Collect host-thread and scheduler figures, pids and time marks (diagnostics.csv)."""
    private_ray: bool = True
    """The sweep started its own Ray on this machine (no node of it can be preempted)."""
    gpu_share: float = 1.0
    """The share of one GPU each of the trial's workers reserves (a fractional GPU in Ray's resources):
    under 1 when it starts beside other trials on one GPU (ray_zero/run/gpu_sharing.py)."""
    gpu_room: Any = None
    """What the shares of its GPU were made in (a gpu_sharing.Room): a trial corrected at its start
    (ray_zero/measure/correction.py) takes its share there again; None: not sharing a GPU."""
    label: str = ""
    """A suffix that tells two trials of one point apart (`fit` times its answer again: "timed")."""
    activations: Any = None
    """The point's training step traced on the meta device before any run (a grid_trace.Traced, from
    ray_zero/train/grid_trace.py), or why it could not be (a str); None: not traced (CPU sweeps, where no
    peak is predicted, unless a profile asks for their step time)."""
    calibration: Optional[dict] = None
    """calibration.json, where the sweep calibrated: the activations of points that were not traced, and a
    check beside those that were."""
    profile: Any = None
    """The device's kernel rates (a measure.gpu_profile.Profile) read once by the driver from
    runtime.profile: the row's step time is predicted on it (rows.py); None: speed not predicted."""

    def __post_init__(self) -> None:
        # On a seq_len axis the model's description is the point's own (its FLOPs, sample bytes, seq_len).
        at = getattr(self.model, "at", None)
        if at is not None:
            object.__setattr__(self, "model", at(self.point.seq_len))

    @property
    def name(self) -> str:
        return self.point.name + (f"_{self.label}" if self.label else "")

    def model_source(self):
        """The model as this point trains it (its seq_len on a seq_len axis)."""
        return self.experiment.model_source(self.point)


def is_calibration(trial: str) -> bool:
    """Whether a row's trial name (TrialSpec.name) is a calibration trial's: it measures memory at a few
    micro-batches in a few steps, for the activations' line, not a point of the grid."""
    return str(trial).endswith("_calibration")
