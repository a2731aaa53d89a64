"""The results table as a frame and as text: rows in table order, markdown cells, the note that says what
the memory columns are, and a recorded row finished with this version's derived columns. The lowest
module of report/: the page, its figures and the tables all read it."""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import pandas as pd

from ray_zero.config import DEFAULT_BUCKET_ELEMENTS
from ray_zero.rows import SORT_KEYS, aggregate_ranks, finish_row, repredicted, results_columns
from ray_zero.schema import TRIAL

NOT_OK = ("oom", "failed", "timeout", "skipped")  # the statuses of a row without a measurement

def markdown_columns() -> list[str]:
    """results.md: what a reader compares (the registry's `md` view); results.csv has them all."""
    return [c.name for c in TRIAL.view("md")]


def with_record_columns(frame: pd.DataFrame, rows: Iterable[dict[str, Any]], view: str) -> pd.DataFrame:
    """The frame (results.csv's columns) with the `view`'s columns that only trials.jsonl keeps (the
    predicted speed), taken from each trial's row; a column blank in every row is left out."""
    by_trial = {str(row.get("trial")): row for row in rows}
    frame = frame.copy()
    for column in TRIAL.view(view):
        if column.name in frame or not len(frame):
            continue
        values = frame["trial"].astype(str).map(lambda t: by_trial.get(t, {}).get(column.name))
        if values.notna().any():
            frame[column.name] = values
    return frame


def rows_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    columns = results_columns()
    frame = pd.DataFrame([{c: row.get(c) for c in columns} for row in rows], columns=columns)
    if len(frame):
        frame = frame.sort_values(SORT_KEYS, kind="stable").reset_index(drop=True)
    return frame


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 10_000:
        value = int(value)  # byte counts in a column that also holds blanks
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}" if abs(value) < 100 else f"{value:.1f}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def cpu_only(frame: pd.DataFrame) -> bool:
    """Every row ran on CPU: the memory columns hold resident sets (their `cpu_heading`)."""
    return len(frame) > 0 and set(frame["memory_kind"].dropna()) == {"cpu_rss"}


def heading(name: str, default: str, cpu: bool) -> str:
    """A column's heading in a table whose rows all ran on CPU (`cpu`) or not."""
    known = TRIAL.by_name.get(name)
    return known.cpu_heading if cpu and known is not None and known.cpu_heading else default


def markdown_table(frame: pd.DataFrame, columns: Optional[list[str]] = None) -> str:
    columns = [c for c in (markdown_columns() if columns is None else columns) if c in frame]
    cpu = "memory_kind" in frame and cpu_only(frame)
    headings = [heading(c, c, cpu) for c in columns]
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(columns)]
    for _, record in frame[columns].iterrows():
        lines.append("| " + " | ".join(_cell(record[c]) for c in columns) + " |")
    return "\n".join(lines)


def memory_note(frame: pd.DataFrame) -> str:
    kinds = set(frame["memory_kind"].dropna()) if len(frame) else set()
    if cpu_only(frame):
        return (
            "CPU rows: peak RSS GiB (`peak_allocated_gib_max` in results.csv) is each worker process's "
            "peak resident set (Python, torch and Ray included), not comparable with GPU memory; the "
            "model states counted tensor by tensor (`measured_model_state_gib`) stand beside what the "
            "memory model predicts for them."
        )
    if kinds == {"cuda"}:
        return (
            "GPU rows: peak CUDA memory allocated per rank (GiB), over the whole trial, engine set-up "
            "included; max over ranks."
        )
    return "Memory columns: peak CUDA allocated on GPU rows, peak resident set on CPU rows."


PREDICTED_WITH = "activation_source"
"""A row that holds this field was predicted, term by term, when it was made: its prediction is read,
never made again unless asked (`report --predict`)."""
PREDICTION_NEEDS = ("model", "params", "stage", "num_workers", "precision", "micro_batch_size")


def finish_recorded(
    row: dict[str, Any], experiment: dict[str, Any], calibration: dict | None, predict: bool = False
) -> dict[str, Any]:
    """A row as trials.jsonl recorded it, its aggregates over ranks and ratios made with this version of
    ray_zero. Its prediction is the one it was made with; a row of a version that stored no terms is
    predicted as its sweep did (with its calibration.json), and `predict` predicts every row again."""
    if row.get("per_rank"):
        row.update(aggregate_ranks(row["per_rank"]))
    row.setdefault("reduce_bucket_size", experiment.get("reduce_bucket_size", DEFAULT_BUCKET_ELEMENTS))
    stored = PREDICTED_WITH in row
    if (predict or not stored) and all(row.get(key) is not None for key in PREDICTION_NEEDS):
        return repredicted(row, calibration)
    return finish_row(row)
