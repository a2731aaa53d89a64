"""The typed records a result travels as: `RankReport` (what one rank reports, ray_zero/train/worker.py)
and `TrialRecord` (a trial's row, every rank's report inside it, one line of trials.jsonl), pydantic
models made from the column registry (ray_zero/schema/rank_columns.py, trial_columns.py).

A record is checked where it crosses a boundary: a rank's report before it leaves the rank, a row before
it is written to trials.jsonl. A key the registry lacks (a misspelt or renamed one) or a value of the
wrong type fails there, naming the key, instead of falling back to a default downstream. What passes is
written as measured: the check converts nothing (an int stays an int, 0 is not made 0.0), so tables
rebuilt from trials.jsonl are byte for byte what they were. Reading keeps earlier versions' rows as they
are: their fields of other names (rank_columns.LEGACY, trial_columns.LEGACY) are kept and shown nowhere.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from ray_zero.schema.columns import Registry
from ray_zero.schema.rank_columns import RANK
from ray_zero.schema.trial_columns import TRIAL


class RecordError(ValueError):
    """A record that does not match the column registry (one line)."""


_STRICT = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=True)


def _type(python_type: type) -> Any:
    # A count where a float goes (a peak of 0, a sum of ints) is kept as written.
    return Optional[Union[float, int]] if python_type is float else Optional[python_type]


def _model(name: str, registry: Registry, **override: Any) -> type[BaseModel]:
    fields = {c.name: (_type(c.type), None) for c in registry.columns}
    fields.update(override)
    return create_model(name, __config__=_STRICT, **fields)


@functools.lru_cache(maxsize=4)
def _models(rank_columns: tuple, trial_columns: tuple) -> tuple[type[BaseModel], type[BaseModel]]:
    """The two records of the registry as it is (made again if a column is renamed there)."""
    rank = _model("RankReport", Registry(rank_columns))
    return rank, _model("TrialRecord", Registry(trial_columns), per_rank=(Optional[list[rank]], None))


RankReport, TrialRecord = _models(RANK.columns, TRIAL.columns)
"""One rank's report (per_rank.csv's columns and what only trials.jsonl keeps); one trial's row, its
ranks' reports in `per_rank`."""


def _check(model: type[BaseModel], values: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        model.model_validate(values)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: "
            + ("not a column of the registry" if e["type"] == "extra_forbidden" else e["msg"])
            for e in error.errors()[:5]
        )
        raise RecordError(f"{what} does not match ray_zero/schema's columns: {problems}") from None
    return values


def rank_report(values: dict[str, Any]) -> dict[str, Any]:
    """`values` checked as a RankReport, returned as they are."""
    return _check(_models(RANK.columns, TRIAL.columns)[0], values, "a rank's report")


def trial_record(row: dict[str, Any]) -> dict[str, Any]:
    """`row` checked as a TrialRecord (its ranks' reports too), returned as it is."""
    return _check(_models(RANK.columns, TRIAL.columns)[1], row, f"the row of trial {row.get('trial')!r}")


def recorded_record(row: dict[str, Any]) -> dict[str, Any]:
    """A row an earlier version recorded, checked as a TrialRecord but for the fields of other names its
    version wrote (LEGACY), which stay in it as they are; returned as it is."""
    from ray_zero.schema.rank_columns import LEGACY as RANK_LEGACY
    from ray_zero.schema.trial_columns import LEGACY as TRIAL_LEGACY

    current = {k: v for k, v in row.items() if k not in TRIAL_LEGACY}
    if isinstance(current.get("per_rank"), list):
        current["per_rank"] = [
            {k: v for k, v in rank.items() if k not in RANK_LEGACY} if isinstance(rank, dict) else rank
            for rank in current["per_rank"]
        ]
    trial_record(current)
    return row


def _aggregates_name_rank_columns() -> None:
    missing = [c.name for c in TRIAL.columns if c.of and c.of not in RANK]
    if missing:  # at import: a trial column aggregating a rank column that does not exist
        raise RecordError(f"trial columns aggregate rank columns the registry lacks: {missing}")


_aggregates_name_rank_columns()
