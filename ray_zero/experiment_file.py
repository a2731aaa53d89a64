"""Experiment files: YAML + `--set` overrides -> a validated Experiment, and bad input as one line.

A ConfigError's message is one line naming the key and what is allowed; the CLI prints it and exits
(status 2) before Ray starts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from ray_zero.config import ConfigError, Experiment, Runtime
from ray_zero.models.source import did_you_mean

# ---------------------------------------------------------------- loading, overrides, messages


def load_experiment(path: Union[str, Path], overrides: tuple[str, ...] | list[str] = ()) -> Experiment:
    """Read a YAML experiment, apply `KEY=VALUE` overrides, validate. Raises ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"experiment file not found: {path} (give a YAML file, e.g. experiments/quick.yaml)"
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the file must hold a mapping of keys (name: ..., grid: ...), not a {type(raw).__name__}"
        )
    raw.setdefault("name", path.stem)
    return validate_experiment(raw, overrides, source=str(path))


def validate_experiment(raw: dict, overrides=(), source: str = "experiment") -> Experiment:
    raw = copy.deepcopy(raw)
    for item in overrides:
        apply_override(raw, item)
    try:
        return Experiment.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(f"{source}: {describe_validation_error(error)}") from None


def apply_override(raw: dict, item: str) -> None:
    """Apply one `--set a.b.c=VALUE` (VALUE parsed as YAML) to the raw mapping, in place."""
    key, sep, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p for p in parts):
        raise ConfigError(
            f"--set {item!r}: expected KEY=VALUE with a dotted KEY, "
            "e.g. --set steps=8 or --set grid.num_workers=[1,2]"
        )
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        raise ConfigError(
            f"--set {item!r}: the value is not valid YAML (lists as [1,2], strings as text or 'quoted')"
        ) from None
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _keys(model: type[BaseModel]) -> list[str]:
    """The YAML keys of a section (a field's alias where it has one: model_config)."""
    return [info.alias or name for name, info in model.model_fields.items()]


def _field(model: type[BaseModel], key: str):
    return next((info for name, info in model.model_fields.items() if key in (name, info.alias)), None)


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that holds the field at `loc` (for 'did you mean' hints)."""
    model: type[BaseModel] | None = Experiment
    for part in loc[:-1]:
        info = _field(model, part) if model is not None and isinstance(part, str) else None
        if info is None:
            return None
        annotation = info.annotation
        candidates = get_args(annotation) if get_origin(annotation) is Union else (annotation,)
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _where(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def describe_validation_error(error: ValidationError) -> str:
    """One line for the first problem: the key, what is wrong, what is allowed."""
    first = error.errors(include_url=False)[0]
    # Drop pydantic's validator and union-branch names ('function-after', 'int', 'Fault') from the path.
    loc = tuple(
        p
        for p in first["loc"]
        if not (
            isinstance(p, str) and (p.startswith("function-") or p[:1].isupper() or p in ("int", "float"))
        )
    )
    where, kind = _where(loc), first["type"]
    if kind == "extra_forbidden":
        model = _model_at(loc)
        allowed = _keys(model) if model else []
        hint = did_you_mean(str(loc[-1]), allowed)
        if model is Experiment and loc[-1] in Runtime.model_fields:  # a launcher knob of earlier versions
            hint = f"; it belongs in the runtime: section (runtime.{loc[-1]})"
        return f"{where}: unknown key{hint}; allowed here: {', '.join(allowed)}"
    if kind == "missing":
        return f"{where}: required key is missing"
    message = first["msg"].removeprefix("Value error, ")
    if message.startswith("Input should"):
        message = "should" + message[len("Input should") :]
    if kind == "value_error":  # our own validators' messages already say what is allowed
        return f"{where}: {message}" if loc else message
    shown = first.get("input")
    if isinstance(shown, (dict, list)) and len(repr(shown)) > 60:
        shown = type(shown).__name__
    return f"{where}: {message}, got {shown!r}"


def field_help(model: type[BaseModel] = Experiment, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, docstring, default) for every field, nested sections included."""
    rows = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{info.alias or name}"
        annotation = info.annotation
        candidates = get_args(annotation) if get_origin(annotation) is Union else (annotation,)
        nested = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        default = info.get_default(call_default_factory=True)
        default = default.model_dump() if isinstance(default, BaseModel) else default
        rows.append((key, info.description or "", default))
        if nested is not None:
            rows.extend(field_help(nested, key + "."))
    return rows
