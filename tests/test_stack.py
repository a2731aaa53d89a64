"""What a sweep checks of the installed stack before Ray starts (ray_zero/run/stack.py), and the
runtime.loggers key: one ConfigError line each, naming what is needed; the Ray Tune switches a sweep sets
for Tuner.fit's span. Pure: no Ray, no training.
The version floors are exercised for real on an older stack by bench/compat.py (bench/compat.md)."""

from __future__ import annotations

import pytest

from ray_zero.config import ConfigError
from ray_zero.experiment_file import validate_experiment
from ray_zero.run import loggers, stack


def experiment(**keys):
    return validate_experiment({"steps": 2, "warmup_steps": 1, **keys})


def test_loggers_take_one_name_or_several_of_the_three():
    assert experiment(runtime={"loggers": "mlflow"}).runtime.loggers == ["mlflow"]
    both = experiment(runtime={"loggers": ["tensorboard", "mlflow"]})
    assert both.runtime.loggers == ["tensorboard", "mlflow"]
    assert experiment().runtime.loggers == []
    with pytest.raises(ConfigError) as error:
        experiment(runtime={"loggers": ["comet"]})
    assert "runtime.loggers" in str(error.value) and "'mlflow'" in str(error.value)
    assert "\n" not in str(error.value)


def test_a_logger_whose_package_is_missing_is_refused_in_one_line(monkeypatch):
    wanted = experiment(runtime={"loggers": ["tensorboard", "mlflow"]})
    stack.check_stack(wanted)  # tensorboardX comes with ray[tune]; requirements.txt installs mlflow-skinny
    monkeypatch.setitem(loggers.PACKAGES, "mlflow", "ray_zero_no_such_package")
    with pytest.raises(
        ConfigError, match=r"^runtime.loggers: mlflow \(ray_zero_no_such_package\) not installed; "
    ):
        stack.check_stack(wanted)


def test_the_installed_stack_meets_its_own_floors():
    """requirements.txt's pins are at or above the floors stack.py checks (pyproject.toml's ranges)."""
    for package, oldest in {**stack.OLDEST, "deepspeed": stack.ZERO3_DEEPSPEED}.items():
        assert stack.installed(package).release >= tuple(int(p) for p in oldest.split("."))
    stack.check_stack(experiment(grid={"stage": [3]}))


def test_tunes_snapshot_period_is_ray_zeros_unless_the_caller_set_one(monkeypatch):
    from ray_zero.run.session import tune_env

    monkeypatch.delenv("TUNE_GLOBAL_CHECKPOINT_S", raising=False)
    env = tune_env({"MLFLOW_ALLOW_FILE_STORE": "true"})
    assert env["TUNE_GLOBAL_CHECKPOINT_S"] == "600" and env["RAY_AIR_NEW_OUTPUT"] == "0"
    assert env["MLFLOW_ALLOW_FILE_STORE"] == "true"
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "auto")
    assert "TUNE_GLOBAL_CHECKPOINT_S" not in tune_env({})  # the caller's own period stays in force
