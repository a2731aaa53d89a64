"""A finished run's folder, read back: `ray_zero.Results` (a sweep's) and `ray_zero.FitResults` (a fit's),
as `ray_zero.sweep` and `ray_zero.fit` return them and `Results.read(folder)` reads one later."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import pandas as pd

from ray_zero.store import EXPERIMENT_FILE

FILES = (
    "results.csv",
    "results.md",
    "per_rank.csv",
    "diagnostics.csv",
    "report.html",
    "trials.jsonl",
    EXPERIMENT_FILE,
    "calibration.json",
    "fit.csv",
    "fit.md",
    "best_config.json",
    "best_ds_config.json",
    "best_experiment.yaml",
    "best_command.txt",
)


@dataclass
class Results:
    """A finished sweep's folder, read: its table (results.csv), each rank's row (per_rank.csv), its files."""

    output: Path
    table: pd.DataFrame
    """One row per trial (results.csv; docs/columns.md says what each column is)."""
    per_rank: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per rank of each trial (per_rank.csv); empty when no trial reported."""

    @property
    def files(self) -> dict[str, Path]:
        """The folder's files by name (results.csv, report.html, ...), those that exist."""
        return {name: self.output / name for name in FILES if (self.output / name).is_file()}

    @classmethod
    def read(cls, output: Union[str, os.PathLike]) -> "Results":
        output = Path(output)
        return cls(output, _csv(output / "results.csv"), _csv(output / "per_rank.csv"))


@dataclass
class FitResults(Results):
    """A finished fit's folder: the sweep's tables of every probe, and the answer per setting."""

    fit: pd.DataFrame = field(default_factory=pd.DataFrame)
    """fit.csv: per (engine, stage, workers, ...) the largest micro-batch within the budget, peak, speed."""
    best_config: Optional[dict] = None
    """The fastest setting that fits, with its engine config (best_config.json)."""
    best_ds_config: Optional[dict] = None
    """The DeepSpeed config the fastest DeepSpeed rank was built with, key for key (best_ds_config.json)."""

    @classmethod
    def read(cls, output: Union[str, os.PathLike]) -> "FitResults":
        output = Path(output)
        return cls(
            output,
            _csv(output / "results.csv"),
            _csv(output / "per_rank.csv"),
            _csv(output / "fit.csv"),
            _json(output / "best_config.json"),
            _json(output / "best_ds_config.json"),
        )


def _csv(path: Path) -> pd.DataFrame:
    return pd.read_csv(path) if path.is_file() else pd.DataFrame()


def _json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None
