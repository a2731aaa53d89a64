"""The installed stack against what a sweep needs, checked before Ray starts (ray_zero.api): the oldest
torch, Ray and DeepSpeed (and Transformers, timm for their models) that bench/compat.py ran on, and the
packages of runtime.loggers. Reads installed versions only: imports none of them."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from typing import Iterator

from packaging.version import Version

from ray_zero.config import ConfigError, Experiment
from ray_zero.run.loggers import missing_packages

OLDEST = {"torch": "2.11", "ray": "2.56.1", "deepspeed": "0.19.0"}
"""The oldest releases the rank-level tests and a CPU sweep passed on (bench/compat.md)."""
OLDEST_FOR_MODELS = {"hf:": ("transformers", "5.17"), "timm:": ("timm", "1.0.29")}
ZERO3_DEEPSPEED = "0.19.4"
"""DeepSpeed 0.19.0-0.19.3's ZeRO-3 saves every gathered parameter for backward (on the tests' toy model
exactly one more fp32 copy of all its parameters, with or without activation checkpointing), which the
memory model does not predict; 0.19.4 on saves what 0.19.8 saves (bench/compat.md)."""


def installed(package: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def check_stack(experiment: Experiment) -> None:
    """One ConfigError line for the first package too old, or a logger whose package is missing."""
    needed = dict(OLDEST)
    for prefix, (package, version) in OLDEST_FOR_MODELS.items():
        if str(experiment.model).startswith(prefix):
            needed[package] = version
    for package, oldest in needed.items():
        found = installed(package)
        if found is not None and found.release < Version(oldest).release:
            raise ConfigError(
                f"{package} {found} is older than ray_zero supports: it needs {package} >= {oldest} "
                f"(pip install '{package}>={oldest}')"
            )
    deepspeed = installed("deepspeed")
    zero3 = "deepspeed" in experiment.grid.backend and 3 in experiment.grid.stage
    if zero3 and deepspeed is not None and deepspeed.release < Version(ZERO3_DEEPSPEED).release:
        raise ConfigError(
            f"grid.stage 3 with backend deepspeed needs deepspeed >= {ZERO3_DEEPSPEED} (found {deepspeed}: "
            "its ZeRO-3 keeps the gathered parameters for backward); upgrade DeepSpeed or leave stage 3 out"
        )
    missing = missing_packages(list(experiment.runtime.loggers))
    if missing:
        raise ConfigError(
            f"runtime.loggers: {', '.join(missing)} not installed; install it (pip install "
            f"'ray_zero[{missing[0].split()[0]}]') or leave it out of runtime.loggers"
        )


def restore_environment(found: dict[str, str]) -> None:
    """This process's environment variables back to `found` (those set since removed, changed ones reset)."""
    for name in set(os.environ) - set(found):
        del os.environ[name]
    for name, value in found.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """The block's changes to this process's environment undone after it (torch sets its inductor's
    TORCHINDUCTOR_CACHE_DIR as a model is described)."""
    found = dict(os.environ)
    try:
        yield
    finally:
        restore_environment(found)
