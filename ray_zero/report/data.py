"""The report page's data, read from one sweep (or fit) folder, and its results table's cells.

It reads what the folder holds and needs neither Ray nor torch nor a network: results.csv (one row per
trial), per_rank.csv (each rank's memory and model-state bytes; optional), experiment.yaml (the question
and the provenance), trials.jsonl (every field of every row, the memory model's prediction term by term
among them) and fit.csv (only a `fit` run has it). Rows of older versions lack
columns: what is missing is left blank, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import pandas as pd

from ray_zero.measure.calibration import read_calibration
from ray_zero.report.formatting import as_number, fmt, percent_text, present, truthy
from ray_zero.report.frame import NOT_OK, cpu_only, finish_recorded, heading, rows_frame
from ray_zero.rows import results_columns
from ray_zero.schema import TRIAL
from ray_zero.store import load_trials, read_experiment_file

REPORT_FILE = "report.html"
def table_columns(cpu: bool = False) -> list[tuple[str, str, str]]:
    """The results table's (column, heading, hover text): the registry's `page` view, headed for rows
    that all ran on CPU where `cpu`; a trial that is not ok says why under its name (the error column)."""
    return [(c.name, heading(c.name, c.heading, cpu), c.hint or c.help) for c in TRIAL.view("page")]


# --------------------------------------------------------------------------------------------- reading


@dataclass
class Sweep:
    """What one output folder holds, read once."""

    folder: Path
    frame: pd.DataFrame
    """results.csv: one row per trial, every column of rows.results_columns() (blank where an older
    version had none)."""
    rows: dict[str, dict[str, Any]]
    """Each trial's finished row (trials.jsonl through rows.finish_row), or its results.csv row."""
    per_rank: Optional[pd.DataFrame]
    experiment: dict[str, Any]
    provenance: dict[str, Any]
    calibration: Optional[dict]
    fit: Optional[pd.DataFrame]


def _normalise(frame: pd.DataFrame) -> pd.DataFrame:
    """Every column of results.csv present; the defaults rows.finish_row gives rows of earlier versions."""
    frame = frame.copy()
    for column in results_columns():
        if column not in frame:
            frame[column] = None
    for column, default in (("backend", "deepspeed"), ("offload_optimizer", "none"), ("status", "failed")):
        values = frame[column].astype(object)  # a column all blank reads as float
        frame[column] = values.where(values.notna(), default)
    frame["activation_checkpointing"] = frame["activation_checkpointing"].map(truthy)
    frame["trial"] = frame["trial"].astype(str)
    return frame


def read_sweep(output_dir: Path) -> Sweep:
    output_dir = Path(output_dir)
    saved = read_experiment_file(output_dir)
    experiment, provenance = saved.get("experiment") or {}, saved.get("provenance") or {}
    calibration = read_calibration(output_dir)
    rows: dict[str, dict[str, Any]] = {}
    for row in load_trials(output_dir):  # as report.rerender does: each row with its own prediction
        rows[str(row.get("trial"))] = finish_recorded(row, experiment, calibration)
    if (output_dir / "results.csv").is_file():
        frame = pd.read_csv(output_dir / "results.csv")
    elif rows:
        frame = rows_frame(rows.values())
    else:
        raise FileNotFoundError(
            f"{output_dir}: neither results.csv nor trials.jsonl here (give a sweep's folder)"
        )
    frame = _normalise(frame)
    for record in frame.to_dict("records"):  # a trial missing from trials.jsonl: its table row
        rows.setdefault(record["trial"], {k: v for k, v in record.items() if present(v)})
    per_rank = None
    if (output_dir / "per_rank.csv").is_file():
        per_rank = pd.read_csv(output_dir / "per_rank.csv")
    else:
        ranks = [r for row in rows.values() for r in row.get("per_rank") or []]
        per_rank = pd.DataFrame(ranks) if ranks else None
    if per_rank is not None and len(per_rank):
        per_rank["trial"] = per_rank["trial"].astype(str)
        if "attempt" in per_rank:  # the last attempt's ranks only
            last = per_rank.groupby("trial")["attempt"].transform("max")
            per_rank = per_rank[per_rank["attempt"].fillna(0) == last.fillna(0)]
    fit = pd.read_csv(output_dir / "fit.csv") if (output_dir / "fit.csv").is_file() else None
    return Sweep(output_dir, frame, rows, per_rank, experiment, provenance, calibration, fit)


def table(
    frame: pd.DataFrame,
    columns: Optional[list[tuple[str, str, str]]] = None,
    keep_constant: Iterable[str] = ("trial", "status", "stage", "num_workers", "micro_batch_size"),
):
    """The table's columns (those the same in every row move to a line above it) and its cells."""
    keep = set(keep_constant)
    shown, constant = [], []
    for column, head, hint in table_columns(cpu_only(frame)) if columns is None else columns:
        if column not in frame:
            continue
        values = frame[column]
        if values.isna().all() and column not in keep:
            continue
        if column not in keep and len(frame) > 1 and values.astype(str).nunique() == 1:
            constant.append(f"{head} {fmt(values.iloc[0])}")
            continue
        shown.append((column, head, hint))
    body = []
    for record in frame.to_dict("records"):
        cells = []
        for column, _, _ in shown:
            value = record.get(column)
            number = as_number(value) if column not in ("trial", "error") else None
            text = fmt(value)
            title = why = ""
            if column == "trial" and record.get("status") in NOT_OK:  # the reason, under the trial's name
                why = fmt(record.get("error")) or "no reason recorded"
                if len(why) > 110:  # the whole reason is in the headline's list and on hover
                    title, why = why, why[:108].rstrip() + "…"
            if column == "mfu" and number is not None:
                text = percent_text(number)
            elif "_gib" in column and number is not None:  # GiB to the hundredth; small ones 3 figures
                text = f"{number:.2f}" if abs(number) >= 1 else f"{number:.3g}"
            elif column.startswith("measured_over_predicted") and number is not None:
                text = f"{number:.3f}"
            if column == "loss_last" and present(record.get("loss_first")):
                text = f"{fmt(record['loss_first'], 3)} → {fmt(value, 3)}"
            cells.append(
                {
                    "text": text,
                    "sort": ""
                    if not present(value)
                    else (repr(number) if number is not None else str(value)),
                    "numeric": number is not None,
                    "column": column,
                    "title": title,
                    "why": why,
                }
            )
        body.append(
            {"status": str(record.get("status") or ""), "cells": cells, "trial": record.get("trial", "")}
        )
    return {
        "columns": [{"key": c, "heading": h, "hint": t} for c, h, t in shown],
        "rows": body,
        "constant": constant,
    }
