"""Values in words for the report layer: numbers read leniently from table cells, cells and sizes as text,
and an engine setting's label ("fsdp stage 3 +ckpt"). The one home of these: the page, its tables and
its figures all format through here."""

from __future__ import annotations

import math
from typing import Any, Optional

import pandas as pd

SETTING_KEYS = ["backend", "stage", "activation_checkpointing", "offload_optimizer"]
"""The columns that make one engine setting (one label, one colour in every figure)."""


def as_number(value: Any) -> Optional[float]:
    """A finite float from a cell (numbers, numeric strings, numpy scalars); None for anything else."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def truthy(value: Any) -> bool:
    """True, "true" (any case) or 1: a flag as results.csv or trials.jsonl may hold it."""
    return (
        value is True
        or (isinstance(value, str) and value.strip().lower() == "true")
        or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and not math.isnan(value)
            and value == 1
        )
    )


def present(value: Any) -> bool:
    """Neither None nor NaN (a blank cell)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def int_text(value: Any) -> str:
    """A whole number without its ".0" ("64"); blank for a missing one; anything else as it is."""
    number = as_number(value)
    return (
        str(int(number))
        if number is not None and number.is_integer()
        else ("" if number is None else str(value))
    )


def fmt(value: Any, digits: int = 4) -> str:
    """A cell: blanks for missing values, thousands separators for counts, 4 significant digits."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # numpy scalars, as pandas hands them out
    if not present(value):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        value = float(value)
        if value.is_integer() and abs(value) >= 1000:
            return f"{int(value):,}"
        if value.is_integer():
            return str(int(value))
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def percent_text(fraction: float) -> str:
    """A fraction as a percentage: "41.3%"; below 1% two significant figures ("0.52%")."""
    return f"{fraction:.1%}" if abs(fraction) >= 0.01 or fraction == 0 else f"{fraction * 100:.2g}%"


def gib_text(value: Any, digits: int = 2) -> str:
    """GiB in words: "18.10 GiB"; below a tenth of a GiB in MiB ("4.19 MiB": a seed model's states)."""
    number = as_number(value)
    if number is None:
        return "-"
    return f"{number * 1024:.3g} MiB" if 0 < abs(number) < 0.1 else f"{number:.{digits}f} GiB"


def setting_label(record: dict[str, Any] | pd.Series) -> str:
    """One engine setting in words: "stage 1", "fsdp stage 3 +ckpt", "stage 2 +offload cpu"."""
    backend = record.get("backend") or "deepspeed"
    label = ("" if backend == "deepspeed" else f"{backend} ") + f"stage {int_text(record.get('stage'))}"
    if truthy(record.get("activation_checkpointing")):
        label += " +ckpt"
    offload = record.get("offload_optimizer")
    if present(offload) and offload != "none":
        label += f" +offload {offload}"
    return label
