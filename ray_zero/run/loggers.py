"""runtime.loggers: every row, flat, to Ray Tune's own logger callbacks (TensorBoard through tensorboardX,
MLflow, Weights & Biases), and where they wrote (loggers.json beside the results, which the report page
links to).

Each logger sees a trial's row as Tune's result (numbers and strings, `_for_tune` in ray_zero/run/trial.py)
and its config flat: the point's fields, its precision and its trial name, not the TrialSpec object the
trial carries. The MLflow client keeps its tracking URI in this process (and in MLFLOW_TRACKING_URI):
`caller_state_kept` puts both back after the sweep. Ray Tune itself writes TensorBoard event files into
every trial's folder whenever tensorboardX is installed, logger or not.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

PACKAGES = {"tensorboard": "tensorboardX", "mlflow": "mlflow", "wandb": "wandb"}
"""The package each logger imports; pip installs it with `ray_zero[mlflow]`, `ray_zero[wandb]`."""
LOGGERS_FILE = "loggers.json"
FILE_STORE_OPT_IN = "MLFLOW_ALLOW_FILE_STORE"


def missing_packages(loggers: list[str]) -> list[str]:
    """`logger (package)` for each logger whose package this Python cannot import (nothing is imported)."""
    return [
        f"{name} ({PACKAGES[name]})" for name in loggers if importlib.util.find_spec(PACKAGES[name]) is None
    ]


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's Tune config as its loggers get it: the point's fields, precision and name."""
    spec = (config.get("trial") or {}).get("spec") if isinstance(config.get("trial"), dict) else None
    if spec is None or not hasattr(spec, "point"):
        return {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool))}
    point = {k: v for k, v in spec.point.fields().items() if v is not None}  # seq_len: on an axis only
    return {"trial": spec.name, **point, "precision": spec.precision}


class _FlatTrial:
    """A trial as the loggers see it: its config flat (`flat_config`), all else the trial's own."""

    def __init__(self, trial):
        self._trial = trial

    def __getattr__(self, name):
        return getattr(self._trial, name)

    @property
    def config(self) -> dict[str, Any]:
        return flat_config(self._trial.config)

    @property
    def evaluated_params(self) -> dict[str, Any]:
        return flat_config(self._trial.config)

    def __str__(self) -> str:
        return str(self._trial)

    def __hash__(self) -> int:
        return hash(self._trial)

    def __eq__(self, other) -> bool:
        return self._trial == (other._trial if isinstance(other, _FlatTrial) else other)


def _flat(logger_class: type) -> type:
    """`logger_class` (a Ray Tune LoggerCallback) fed each trial through _FlatTrial."""

    class Flat(logger_class):
        def log_trial_start(self, trial):
            super().log_trial_start(_FlatTrial(trial))

        def log_trial_result(self, iteration, trial, result):
            if isinstance(result.get("config"), dict):  # Tune's copy of the trial's config in its result
                result = {**result, "config": flat_config(result["config"])}
            super().log_trial_result(iteration, _FlatTrial(trial), result)

        def log_trial_end(self, trial, failed=False):
            super().log_trial_end(_FlatTrial(trial), failed)

    Flat.__name__ = Flat.__qualname__ = f"Flat{logger_class.__name__}"
    return Flat


def logger_callbacks(
    loggers: list[str], name: str, output_dir: Path, tune_path: str
) -> tuple[list, dict[str, str]]:
    """Ray Tune's logger callbacks for `loggers`, and the environment they need while Tune runs (set for
    Tuner.fit's span only); where each writes goes to loggers.json. `name`: the experiment's (MLflow's
    experiment, W&B's project unless WANDB_PROJECT says); `tune_path`: the Tune run's folder, whose trial
    folders hold TensorBoard's event files."""
    callbacks, where, env = [], {}, {}
    if "tensorboard" in loggers:
        from ray.tune.logger import TBXLoggerCallback

        callbacks.append(_flat(TBXLoggerCallback)())
        where["tensorboard"] = {"logdir": tune_path, "command": f"tensorboard --logdir {tune_path}"}
    if "mlflow" in loggers:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        command = f"mlflow ui --backend-store-uri {uri}"
        if not uri:  # a file store in the output folder: MLflow 3 serves one only when told it may
            uri = (output_dir / "mlruns").resolve().as_uri()
            env[FILE_STORE_OPT_IN] = "true"
            command = f"{FILE_STORE_OPT_IN}=true mlflow ui --backend-store-uri {uri}"
        callbacks.append(_flat(MLflowLoggerCallback)(tracking_uri=uri, experiment_name=name))
        where["mlflow"] = {"tracking_uri": uri, "experiment": name, "command": command}
    if "wandb" in loggers:
        from ray.air.integrations.wandb import WandbLoggerCallback

        project = os.environ.get("WANDB_PROJECT") or name
        # Its own folder: a trial's Tune folder is copied to the storage path before W&B has finished.
        callbacks.append(_flat(WandbLoggerCallback)(project=project, dir=str(output_dir.resolve())))
        mode = os.environ.get("WANDB_MODE", "online")
        where["wandb"] = {
            "project": project,
            "mode": mode,
            "runs": str(output_dir.resolve() / "wandb"),
        }
    if where:
        (output_dir / LOGGERS_FILE).write_text(json.dumps(where, indent=1) + "\n")
    return callbacks, env


@contextlib.contextmanager
def caller_state_kept(*names: str) -> Iterator[None]:
    """The environment variables `names`, and MLflow's tracking and registry URIs where MLflow is imported
    in the end, as they were before the block: Ray Tune's loggers set them in this process."""
    before = {name: os.environ.get(name) for name in (*names, "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow = sys.modules.get("mlflow")
    uris = (mlflow.get_tracking_uri(), mlflow.get_registry_uri()) if mlflow else (None, None)
    try:
        yield
    finally:
        mlflow_now = sys.modules.get("mlflow")
        if mlflow_now is not None:  # None: the URIs a fresh import has
            mlflow_now.set_tracking_uri(uris[0])
            mlflow_now.set_registry_uri(uris[1])
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
