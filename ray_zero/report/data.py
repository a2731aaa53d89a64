"""The report page's data, read from one sweep (or fit) folder: the header, the headline and the results
table.

It reads what the folder holds and needs neither Ray nor torch nor a network: results.csv (one row per
trial), per_rank.csv (each rank's memory and model-state bytes; optional), experiment.yaml (the question
and the provenance), trials.jsonl (every field of every row: the memory model's prediction is recomputed
from it, component by component) and fit.csv (only a `fit` run has it). Rows of older versions lack
columns: what is missing is left blank, never guessed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import pandas as pd

from ray_zero.measure.calibration import read_calibration
from ray_zero.report.frame import finish_recorded, rows_frame
from ray_zero.rows import COLUMNS
from ray_zero.store import load_trials, read_experiment_file

REPORT_FILE = "report.html"
SETTING_KEYS = ["backend", "stage", "activation_checkpointing", "offload_optimizer"]
NOT_OK = ("oom", "failed", "skipped")
TABLE_COLUMNS = [  # (results.csv column, heading, hover text)
    ("trial", "trial", "the trial's name: its grid point"),
    ("backend", "backend", "deepspeed, torch_zero (DDP + ZeroRedundancyOptimizer) or fsdp (FSDP2)"),
    ("stage", "stage", "ZeRO stage"),
    ("micro_batch_size", "micro-batch", "samples per rank per step"),
    ("num_workers", "workers", "data-parallel ranks"),
    ("activation_checkpointing", "ckpt", "activation checkpointing"),
    ("offload_optimizer", "offload", "where the optimizer's states live"),
    ("precision", "precision", "training precision"),
    ("model", "model", "model"),
    ("params", "params", "parameters"),
    ("dataset", "dataset", "dataset"),
    ("steps", "steps", "optimizer steps"),
    ("status", "status", "ok, oom (out of memory), failed or skipped"),
    ("loss_last", "loss", "loss at the first step -> the last, mean over ranks (sorts by the last)"),
    ("samples_per_s", "samples/s", "timed steps, summed over ranks"),
    ("samples_per_s_per_worker", "per rank", "samples/s per rank"),
    ("mfu", "MFU", "model FLOPs utilisation (GPU)"),
    (
        "peak_allocated_gib_max",
        "peak GiB",
        "peak memory per rank, max over ranks (CUDA allocated; on CPU the worker's resident set)",
    ),
    ("predicted_peak_gib", "predicted peak", "the memory model's peak per rank (GPU)"),
    ("measured_over_predicted", "measured / predicted", "peak measured over predicted (ok GPU rows)"),
    ("measured_model_state_gib", "states GiB", "model states counted tensor by tensor, max over ranks"),
    ("predicted_model_state_gib", "predicted states", "the memory model's model states per rank"),
    ("memory_kind", "memory", "cuda: the CUDA allocator's peak; cpu_rss: the process's resident set"),
    ("wall_s", "wall s", "the trial's wall time"),
    ("attempts", "attempts", "attempts the trial took"),
]
"""The results table's columns; a trial that is not ok says why under its name (the error column)."""


# --------------------------------------------------------------------------------------------- reading


@dataclass
class Sweep:
    """What one output folder holds, read once."""

    folder: Path
    frame: pd.DataFrame
    """results.csv: one row per trial, every column of rows.COLUMNS (blank where an older version had
    none)."""
    rows: dict[str, dict[str, Any]]
    """Each trial's finished row (trials.jsonl through rows.finish_row), or its results.csv row."""
    per_rank: Optional[pd.DataFrame]
    experiment: dict[str, Any]
    provenance: dict[str, Any]
    calibration: Optional[dict]
    fit: Optional[pd.DataFrame]


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value


def _truthy(value: Any) -> bool:
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


def _normalise(frame: pd.DataFrame) -> pd.DataFrame:
    """Every column of COLUMNS present; the defaults rows.finish_row gives rows of earlier versions."""
    frame = frame.copy()
    for column in COLUMNS:
        if column not in frame:
            frame[column] = None
    for column, default in (("backend", "deepspeed"), ("offload_optimizer", "none"), ("status", "failed")):
        values = frame[column].astype(object)  # a column all blank reads as float
        frame[column] = values.where(values.notna(), default)
    frame["activation_checkpointing"] = frame["activation_checkpointing"].map(_truthy)
    frame["trial"] = frame["trial"].astype(str)
    return frame


def read_sweep(output_dir: Path) -> Sweep:
    output_dir = Path(output_dir)
    saved = read_experiment_file(output_dir)
    experiment, provenance = saved.get("experiment") or {}, saved.get("provenance") or {}
    calibration = read_calibration(output_dir)
    rows: dict[str, dict[str, Any]] = {}
    for row in load_trials(output_dir):  # as report.rerender does: this version's derived columns
        try:
            rows[str(row["trial"])] = finish_recorded(row, experiment, calibration)
        except (KeyError, TypeError, ValueError):
            rows[str(row.get("trial"))] = row  # a row too old to predict: shown as recorded
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
        rows.setdefault(record["trial"], {k: v for k, v in record.items() if _present(v)})
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


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


# --------------------------------------------------------------------------------------------- wording


def setting_label(record: dict[str, Any] | pd.Series) -> str:
    """One engine setting in words: "stage 1", "fsdp stage 3 +ckpt", "stage 2 +offload cpu"."""
    backend = record.get("backend") or "deepspeed"
    label = ("" if backend == "deepspeed" else f"{backend} ") + f"stage {_int_text(record.get('stage'))}"
    if _truthy(record.get("activation_checkpointing")):
        label += " +ckpt"
    offload = record.get("offload_optimizer")
    if _present(offload) and offload != "none":
        label += f" +offload {offload}"
    return label


def _int_text(value: Any) -> str:
    number = _number(value)
    return (
        str(int(number))
        if number is not None and number.is_integer()
        else ("" if number is None else str(value))
    )


def fmt(value: Any, digits: int = 4) -> str:
    """A cell: blanks for missing values, thousands separators for counts, 4 significant digits."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()  # numpy scalars, as pandas hands them out
    if not _present(value):
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


def _percent(fraction: float) -> str:
    return f"{fraction:.1%}" if abs(fraction) >= 0.01 or fraction == 0 else f"{fraction * 100:.2g}%"


def _gib(value: Any, digits: int = 2) -> str:
    """GiB in words: "18.10 GiB"; below a tenth of a GiB in MiB ("4.19 MiB": a seed model's states)."""
    number = _number(value)
    if number is None:
        return "-"
    return f"{number * 1024:.3g} MiB" if 0 < abs(number) < 0.1 else f"{number:.{digits}f} GiB"


def device_memory(sweep: Sweep) -> tuple[Optional[float], str]:
    """The device's memory in GiB and where that figure comes from, where the folder says it."""
    if sweep.per_rank is not None and "device_memory_gib" in sweep.per_rank:
        values = [v for v in map(_number, sweep.per_rank["device_memory_gib"]) if v]
        if values:
            return max(values), "the ranks' device memory"
    value = _number(sweep.provenance.get("gpu_memory_gib"))
    if value:
        return value, "the sweep's provenance"
    for error in sweep.frame["error"].dropna():  # torch's out-of-memory message names the capacity
        found = re.search(r"total capacity of ([\d.]+) GiB", str(error))
        if found:
            return float(found.group(1)), "an out-of-memory error's message"
    return None, ""


def header(sweep: Sweep) -> dict[str, Any]:
    prov, experiment, frame = sweep.provenance, sweep.experiment, sweep.frame
    name = prov.get("experiment") or experiment.get("name") or sweep.folder.name
    question = (prov.get("question") or experiment.get("question") or "").strip()
    first = frame.iloc[0].to_dict() if len(frame) else {}
    models = list(dict.fromkeys(frame["model"].dropna().astype(str)))
    model = ", ".join(models) or str(experiment.get("model") or "?")
    params = _number(first.get("params"))
    model_text = model + (f" ({int(params):,} parameters)" if params and len(models) == 1 else "")
    hardware = [
        str(prov[k])
        for k in ("hardware", "driver_gpus", "cluster", "cpu")
        if prov.get(k) and not (k == "driver_gpus" and prov[k] == "none")
    ]
    memory, source = device_memory(sweep)
    if memory:
        hardware.append(f"{memory:.1f} GiB per device (from {source})")
    devices = (
        list(dict.fromkeys(sweep.per_rank["device_name"].dropna().astype(str)))
        if sweep.per_rank is not None and "device_name" in sweep.per_rank
        else []
    )
    if devices and not any(d in " ".join(hardware) for d in devices):
        hardware.append("ranks on " + ", ".join(devices))
    versions = prov.get("versions") if isinstance(prov.get("versions"), dict) else {}
    versions = {**{k: prov[k] for k in ("python", "torch", "deepspeed", "ray") if prov.get(k)}, **versions}
    shown = {
        "experiment",
        "question",
        "date",
        "command",
        "versions",
        "hardware",
        "driver_gpus",
        "cluster",
        "cpu",
        "gpu_memory_gib",
        "python",
        "torch",
        "deepspeed",
        "ray",
    }
    others = {k: v for k, v in prov.items() if k not in shown and _present(v) and v != ""}
    precisions = list(dict.fromkeys(frame["precision"].dropna().astype(str)))
    datasets = list(dict.fromkeys(frame["dataset"].dropna().astype(str)))
    return {
        "name": name,
        "question": question,
        "model": model_text,
        "training": ", ".join(
            filter(
                None,
                [
                    ", ".join(precisions),
                    ", ".join(datasets),
                    f"{_int_text(first.get('steps'))} steps" if first.get("steps") else "",
                ],
            )
        ),
        "hardware": "; ".join(hardware) or "not recorded",
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()) or "not recorded",
        "date": prov.get("date") or "not recorded",
        "command": prov.get("command") or "",
        "others": others,
        "folder": sweep.folder.name,
        "is_fit": sweep.fit is not None,
    }


def headline(sweep: Sweep) -> dict[str, Any]:
    """For each worker count, the fastest configuration that fitted (status ok); the count by status."""
    frame = sweep.frame
    counts = frame["status"].value_counts().to_dict()
    order = ["ok", *NOT_OK] + sorted(set(counts) - {"ok", *NOT_OK})
    summary = f"{len(frame)} trials: " + ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    ok = frame[(frame["status"] == "ok") & frame["samples_per_s"].notna()]
    fit_note = ""
    if sweep.fit is not None:  # a fit's probes run 3 steps: its timed reruns (…_timed) say the speed
        timed = ok[ok["trial"].str.endswith("_timed")]
        if len(timed):
            ok, fit_note = timed, "timed runs of each setting's largest fitting micro-batch"
    cpu = set(frame["memory_kind"].dropna()) == {"cpu_rss"}
    best = []
    for workers, group in ok.groupby("num_workers", sort=True):
        winner = group.sort_values("samples_per_s", ascending=False).iloc[0].to_dict()
        runner = (
            group.sort_values("samples_per_s", ascending=False).iloc[1].to_dict() if len(group) > 1 else None
        )
        memory = (
            f"peak resident set {_gib(winner['peak_allocated_gib_max'])} per worker, model states "
            f"{_gib(winner['measured_model_state_gib'])}"
            if cpu
            else f"peak {_gib(winner['peak_allocated_gib_max'])} per rank"
            + (
                f" (predicted {_gib(winner['predicted_peak_gib'])})"
                if _present(winner["predicted_peak_gib"])
                else ""
            )
        )
        speed = f"{fmt(winner['samples_per_s'])} samples/s"
        if _present(winner.get("mfu")):
            speed += f", MFU {_percent(float(winner['mfu']))}"
        lightest = group.sort_values("peak_allocated_gib_max").iloc[0].to_dict()
        best.append(
            {
                "workers": _int_text(workers),
                "setting": setting_label(winner),
                "micro_batch": _int_text(winner["micro_batch_size"]),
                "trial": winner["trial"],
                "speed": speed,
                "memory": memory,
                "of": len(group),
                "runner_up": (
                    f"next: {setting_label(runner)}, micro-batch {_int_text(runner['micro_batch_size'])}, "
                    f"{fmt(runner['samples_per_s'])} samples/s, {_gib(runner['peak_allocated_gib_max'])}"
                )
                if runner
                else "",
                "lightest": (
                    f"least memory: {setting_label(lightest)}, micro-batch "
                    f"{_int_text(lightest['micro_batch_size'])}, {_gib(lightest['peak_allocated_gib_max'])}, "
                    f"{fmt(lightest['samples_per_s'])} samples/s"
                )
                if lightest["trial"] != winner["trial"]
                else "",
            }
        )
    reasons = {}
    for record in frame[frame["status"].isin(NOT_OK)].to_dict("records"):
        reason = str(record.get("error") or "no reason recorded")
        reasons.setdefault((record["status"], reason), []).append(record["trial"])
    not_ok = [{"status": s, "reason": r, "trials": t} for (s, r), t in reasons.items()]
    return {"summary": summary, "best": best, "not_ok": not_ok, "fit_note": fit_note}


def table(
    frame: pd.DataFrame,
    columns: list[tuple[str, str, str]] = TABLE_COLUMNS,
    keep_constant: Iterable[str] = ("trial", "status", "stage", "num_workers", "micro_batch_size"),
):
    """The table's columns (those the same in every row move to a line above it) and its cells."""
    keep = set(keep_constant)
    shown, constant = [], []
    for column, heading, hint in columns:
        if column not in frame:
            continue
        values = frame[column]
        if values.isna().all() and column not in keep:
            continue
        if column not in keep and len(frame) > 1 and values.astype(str).nunique() == 1:
            constant.append(f"{heading} {fmt(values.iloc[0])}")
            continue
        shown.append((column, heading, hint))
    body = []
    for record in frame.to_dict("records"):
        cells = []
        for column, _, _ in shown:
            value = record.get(column)
            number = _number(value) if column not in ("trial", "error") else None
            text = fmt(value)
            title = why = ""
            if column == "trial" and record.get("status") in NOT_OK:  # the reason, under the trial's name
                why = fmt(record.get("error")) or "no reason recorded"
                if len(why) > 110:  # the whole reason is in the headline's list and on hover
                    title, why = why, why[:108].rstrip() + "…"
            if column == "mfu" and number is not None:
                text = _percent(number)
            elif "_gib" in column and number is not None:  # GiB to the hundredth; small ones 3 figures
                text = f"{number:.2f}" if abs(number) >= 1 else f"{number:.3g}"
            elif column == "measured_over_predicted" and number is not None:
                text = f"{number:.3f}"
            if column == "loss_last" and _present(record.get("loss_first")):
                text = f"{fmt(record['loss_first'], 3)} → {fmt(value, 3)}"
            cells.append(
                {
                    "text": text,
                    "sort": ""
                    if not _present(value)
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
