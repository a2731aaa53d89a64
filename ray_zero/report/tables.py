"""A sweep's tables from its rows: results.csv, results.md, per_rank.csv, diagnostics.csv (with
`--diagnostics`), the console's table, and `report DIR` to rebuild them all. Needs neither Ray nor a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pandas as pd

from ray_zero.config import is_calibration
from ray_zero.experiment_file import validate_experiment
from ray_zero.measure.calibration import read_calibration, write_calibration
from ray_zero.report.frame import (
    NOT_OK,
    cpu_only,
    finish_recorded,
    heading,
    markdown_table,
    memory_note,
    rows_frame,
    with_record_columns,
)
from ray_zero.report.page import write_html_report
from ray_zero.rows import aggregate_ranks, per_rank_columns
from ray_zero.schema import TRIAL
from ray_zero.store import atomic_write, load_trials, read_experiment_file, replace_trials

_UNSTABLE = "timing_min_s or timing_spread not met within the timed steps (timing_max_steps)"


def row_notes(frame: pd.DataFrame, rows: list[dict[str, Any]]) -> list[str]:
    """What trials.jsonl alone holds, said once per value with its trials in table order: what each ok
    row's prediction rests on, why MFU is blank, the profile the speed was predicted on and what that
    prediction leaves out, which rows' timing never met its bound."""
    by_trial = {str(row.get("trial")): row for row in rows}
    ordered = [by_trial[t] for t in frame["trial"].astype(str) if t in by_trial] if len(frame) else []
    notes = (
        ("Predictions", lambda r: r.get("status") == "ok" and r.get("prediction")),
        ("MFU blank", lambda r: r.get("status") == "ok" and r.get("mfu_blank")),
        ("Speed predicted on", lambda r: r.get("speed_profile")),
        ("Predicted speed", lambda r: r.get("speed_profile") and r.get("speed_note")),
        ("Timing not stable", lambda r: r.get("timing_unstable") and _UNSTABLE),
    )
    parts: list[str] = []
    for title, said in notes:
        groups: dict[str, list[str]] = {}
        for row in ordered:
            if said(row):
                groups.setdefault(str(said(row)), []).append(str(row["trial"]))
        if groups:
            named = {
                text: "every row" if len(trials) == len(ordered) else ", ".join(trials)
                for text, trials in groups.items()
            }
            parts += [f"{title}:", ""] + [f"- {text}: {trials}" for text, trials in named.items()] + [""]
    return parts


def render_markdown(
    frame: pd.DataFrame, rows: list[dict[str, Any]], provenance: dict[str, Any] | None
) -> str:
    title = (provenance or {}).get("experiment", "sweep")
    parts = [f"# {title}: results", ""]
    if provenance:
        parts += [f"- {key}: {value}" for key, value in provenance.items() if key != "experiment"] + [""]
    parts += [memory_note(frame), "", markdown_table(with_record_columns(frame, rows, "md")), ""]
    parts += row_notes(frame, rows)
    failures = frame[frame["status"].isin(NOT_OK)] if len(frame) else frame
    if len(failures):
        parts += (
            ["Not ok:", ""] + [f"- {r.trial}: {r.status}: {r.error}" for r in failures.itertuples()] + [""]
        )
    return "\n".join(parts)


def write_results(
    output_dir: Path, rows: list[dict[str, Any]], provenance: dict[str, Any] | None
) -> pd.DataFrame:
    """(Re)write results.csv, results.md, per_rank.csv and diagnostics.csv atomically; return the table."""
    frame = rows_frame(rows)
    atomic_write(output_dir / "results.csv", frame.to_csv(index=False))
    atomic_write(output_dir / "results.md", render_markdown(frame, rows, provenance))
    per_rank = [r for row in rows for r in row.get("per_rank") or []]
    if per_rank:
        table = pd.DataFrame(per_rank)
        table = table[[c for c in per_rank_columns() if c in table]]
        atomic_write(output_dir / "per_rank.csv", table.to_csv(index=False))
    diagnostics = [r for row in rows for r in row.get("diagnostics") or []]
    if diagnostics:
        atomic_write(output_dir / "diagnostics.csv", pd.DataFrame(diagnostics).to_csv(index=False))
    return frame


def rerender(output_dir: Path, predict: bool = False) -> pd.DataFrame:
    """`python -m ray_zero report DIR`: the tables, figures and report page again, without Ray.

    From trials.jsonl (the measurements and each row's prediction as recorded), the aggregates and ratios
    made with this version of ray_zero. `predict` (`report DIR --predict`): every row predicted again by
    this version, its step traced again on the meta device, and trials.jsonl rewritten with it."""
    frame = rerender_tables(output_dir, predict)
    write_pages(output_dir, frame)
    return frame


def rerender_tables(output_dir: Path, predict: bool = False) -> pd.DataFrame:
    """rerender's tables (results.csv, results.md, per_rank.csv), without the page and its figures."""
    rows = load_trials(output_dir)
    if not rows:
        raise FileNotFoundError(f"{output_dir}: no trials.jsonl here (give the --output folder of a sweep)")
    saved = read_experiment_file(output_dir)
    experiment = saved.get("experiment") or {}
    calibration = _recalibrate(output_dir, rows, experiment) or read_calibration(output_dir)
    if predict:
        from ray_zero.report.retrace import retraced

        rows = retraced(rows, experiment, str(output_dir))
    rows = [finish_recorded(row, experiment, calibration, predict) for row in rows]
    if predict:
        replace_trials(output_dir, rows)
    return write_results(output_dir, rows, saved.get("provenance"))


def _recalibrate(output_dir: Path, rows: list[dict], experiment: dict) -> dict | None:
    """calibration.json again from the calibration trials' rows, with this version's arithmetic (not for a
    folder that kept no experiment.yaml: the rows keep the predictions they were recorded with)."""
    measured = [row for row in rows if is_calibration(row.get("trial", ""))]
    if not measured or not experiment:
        return None
    for row in measured:
        row.update(aggregate_ranks(row.get("per_rank") or []))
    return write_calibration(
        output_dir,
        validate_experiment(experiment, source=str(output_dir)),
        measured,
        measured[0].get("memory_kind") == "cuda",
        measured[0].get("precision"),
    )


def write_pages(output_dir: Path, frame: pd.DataFrame, figure_rows: Optional[int] = None) -> None:
    """The report page and its figure files (page.FIGURE_FILES). The page reads the tables just written,
    not `frame`; `figure_rows`: the figures drawn from at most that many rows (page.render)."""
    write_html_report(output_dir, figure_rows)


def console_table(frame: pd.DataFrame, width: int = 120) -> str:
    """The final table, within `width` characters: on CPU the model-state columns replace the peak's
    prediction (an RSS beside a GPU prediction would tell nothing)."""
    cpu = cpu_only(frame)
    names = {
        c.name: heading(c.name, c.heading, cpu)
        for c in TRIAL.view("console", "console_cpu" if cpu else "console_gpu")
    }
    shown = frame[list(names)].rename(columns=names)
    text = shown.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-")
    return "\n".join(line[:width] for line in text.splitlines())
