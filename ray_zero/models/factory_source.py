"""`path/to/file.py:function` and `package.module:function`: a user's factory, called with model_config
as keyword arguments; it returns a ModelSpec, or an nn.Module classifier (then the experiment gives
input_shape and num_classes). Files and modules are read from the working directory. torch only."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from torch import nn

from ray_zero.models.source import (
    Built,
    ModelError,
    checkpoint_blocks,
    classifier,
    did_you_mean,
    one_line,
    refuse,
)
from ray_zero.models.spec import ModelSpec

FACTORY = re.compile(r"(?P<target>[^:]+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*)")
"""The two factory forms: a .py file or a dotted module, a colon, a function name."""


def build_factory(
    source: str, target: str, function: str, config: dict, seq_len, input_shape, num_classes
) -> Built:
    refuse(source, "a factory gets model_config only", seq_len=seq_len)
    factory = _load_factory(source, target, function)
    try:
        made = factory(**config)
    except Exception as error:
        raise ModelError(f"factory {source} raised {one_line(error)}") from None
    if isinstance(made, ModelSpec):
        refuse(
            source, "its ModelSpec makes its own batches", input_shape=input_shape, num_classes=num_classes
        )
        if made.enable_checkpointing is None and made.blocks:  # the protocol's default, made explicit
            made = replace(made, enable_checkpointing=checkpoint_blocks(made.blocks))
        return Built(made, "factory", "custom")
    if not isinstance(made, nn.Module):
        raise ModelError(f"factory {source} returned {type(made).__name__}, not an nn.Module or a ModelSpec")
    if input_shape is None or num_classes is None:
        raise ModelError(
            f"factory {source} returned a plain nn.Module: give input_shape (e.g. [3, 32, 32]) and "
            "num_classes for its images and labels, or return a ModelSpec"
        )
    return classifier(made, input_shape, num_classes, "factory")


def _load_factory(source: str, target: str, function: str) -> Callable[..., Any]:
    """The factory function; files are read relative to the working directory, which is also put on
    sys.path for package.module forms (Ray ships the working directory to the workers)."""
    cwd = os.getcwd()
    if target.endswith(".py"):
        path = Path(cwd, target)
        if not path.is_file():
            raise ModelError(f"factory file {target!r} not found (model {source!r}, read from {cwd})")
        name = "ray_zero_user_" + re.sub(r"\W", "_", str(path.with_suffix("")))
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickle look their module up here
        try:
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:
            del sys.modules[name]
            raise ModelError(f"importing factory file {target!r} failed: {one_line(error)}") from None
    else:
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as error:
            if error.name and (target + ".").startswith(error.name + "."):
                raise ModelError(
                    f"factory module {target!r} not found (model {source!r}; "
                    "is it installed or under the working directory?)"
                ) from None
            raise ModelError(f"importing factory module {target!r} failed: {one_line(error)}") from None
        except (Exception, SystemExit) as error:
            raise ModelError(f"importing factory module {target!r} failed: {one_line(error)}") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ModelError(
            f"factory function {function!r} not found in {target!r}{did_you_mean(function, names)}"
        )
    return factory
