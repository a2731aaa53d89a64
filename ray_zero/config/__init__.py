"""The typed experiment: Experiment (validated once, where it is read), its sections, its grid's Points,
and the TrialSpec that carries one point, typed, from the sweep to every rank.

A package, not sibling modules beside ray_zero/config.py, so that it stays one layer of pyproject.toml's
import-linter contract ("ray_zero.config" covers every module in it) and `from ray_zero.config import X`
keeps working everywhere; the modules inside import only downwards: points < sections < experiment <
trial_spec. Reading YAML, `--set` overrides and the one-line messages live in ray_zero/experiment_file.py.
"""

from ray_zero.config.experiment import DEFAULT_BUCKET_ELEMENTS, PRESET_NAMES, ConfigError, Experiment
from ray_zero.config.points import (
    BACKEND_STAGES,
    ENGINES,
    OFFLOADS,
    Backend,
    EngineEntry,
    Offload,
    Point,
    Stage,
    registered,
    unsupported,
)
from ray_zero.config.sections import (
    SECRET_QUERY_KEYS,
    Fault,
    FineTune,
    Grid,
    Lora,
    Optimizer,
    Runtime,
    StrictModel,
)
from ray_zero.config.trial_spec import TrialSpec, is_calibration

__all__ = [
    "BACKEND_STAGES",
    "ENGINES",
    "EngineEntry",
    "DEFAULT_BUCKET_ELEMENTS",
    "OFFLOADS",
    "PRESET_NAMES",
    "SECRET_QUERY_KEYS",
    "Backend",
    "ConfigError",
    "Experiment",
    "Fault",
    "FineTune",
    "Grid",
    "Offload",
    "Optimizer",
    "is_calibration",
    "Lora",
    "Point",
    "Runtime",
    "Stage",
    "StrictModel",
    "TrialSpec",
    "registered",
    "unsupported",
]
