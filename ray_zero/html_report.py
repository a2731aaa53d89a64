"""report.html: one self-contained page of a sweep (or fit) folder, for people rather than scripts.

    from ray_zero.html_report import write_html_report
    write_html_report(Path("results/memory_scaling-h200x2"))   # -> results/memory_scaling-h200x2/report.html

It reads what the folder holds and needs neither Ray nor torch nor a network: results.csv (one row per
trial), per_rank.csv (each rank's memory and model-state bytes; optional), experiment.yaml (the question
and the provenance), trials.jsonl (every field of every row: the memory model's prediction is recomputed
from it, component by component) and fit.csv (only a `fit` run has it). Rows of older versions lack
columns: what is missing is left blank, never guessed.

Figures are matplotlib, written as inline SVG, not Plotly. Why: Plotly's page needs its script inlined
to work offline, 4.8 MB (plotly.js of plotly 7.1: 4,815,765 bytes) before the first point, in every
results folder that git keeps; the SVG page of the 8-trial memory_scaling sweep is 0.11 MB, a 50-trial
one 0.36 MB. SVG draws without any script, prints as sharp vectors, and matplotlib already draws the
project's PNGs. What Plotly would add is hovering and zooming; every number is in the sortable table
instead, and each marker carries an SVG <title> (the browser shows it on hover). Each drawn marker has an
id naming its figure, its role and its trial (`fig3--measured--stage1_mb64_w2`), so a test counts them in
the rendered page.
"""
from __future__ import annotations

import html
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402
from jinja2 import Environment, FileSystemLoader, select_autoescape  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ray_zero.memory_model import GIB, predict_point  # noqa: E402
from ray_zero.rows import COLUMNS, SORT_KEYS, aggregate_ranks, finish_row  # noqa: E402
from ray_zero.store import atomic_write, load_trials, read_experiment_file  # noqa: E402

REPORT_FILE = "report.html"
TEMPLATES = Path(__file__).parent / "templates"
SETTING_KEYS = ["backend", "stage", "activation_checkpointing", "offload_optimizer"]
NOT_OK = ("oom", "failed", "skipped")
COMPONENTS = [  # (key, label, colour) of the breakdown's stacked bars, bottom to top
    ("parameter_bytes", "parameters", "#4c72b0"),
    ("gradient_bytes", "gradients", "#dd8452"),
    ("master_param_bytes", "master weights (fp32)", "#55a868"),
    ("optimizer_state_bytes", "optimizer states", "#c44e52"),
    ("activation_bytes", "activations (saved for backward)", "#8172b3"),
    ("rest_bytes", "the rest", "#b7b7b7"),
    ("unsplit_bytes", "activations + the rest (peak - states)", "#d7cce8"),
]
"""unsplit: rows that did not count the bytes saved for backward (earlier versions) show the peak less the
model states as one part."""
PREDICTED_REST = [("bucket_bytes", "buckets"), ("step_transient_bytes", "step temporaries"),
                  ("compute_bytes", "gathered/cast parameters"), ("workspace_bytes", "cuBLAS workspaces"),
                  ("data_bytes", "data")]
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
    ("peak_allocated_gib_max", "peak GiB", "peak memory per rank, max over ranks (CUDA allocated; "
                                           "on CPU the worker's resident set)"),
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
    """results.csv: one row per trial, every column of rows.COLUMNS (blank where an older version had none)."""
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
    return value is True or (isinstance(value, str) and value.strip().lower() == "true") or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value) and value == 1)


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
    from ray_zero.report import read_calibration, rows_frame

    output_dir = Path(output_dir)
    saved = read_experiment_file(output_dir)
    experiment, provenance = saved.get("experiment") or {}, saved.get("provenance") or {}
    calibration = read_calibration(output_dir)
    rows: dict[str, dict[str, Any]] = {}
    for row in load_trials(output_dir):  # as report.rerender does: this version's derived columns
        try:
            if row.get("per_rank"):
                row.update(aggregate_ranks(row["per_rank"]))
            row.setdefault("reduce_bucket_size", experiment.get("reduce_bucket_size", 50_000_000))
            rows[str(row["trial"])] = finish_row(row, calibration)
        except (KeyError, TypeError, ValueError):
            rows[str(row.get("trial"))] = row  # a row too old to predict: shown as recorded
    if (output_dir / "results.csv").is_file():
        frame = pd.read_csv(output_dir / "results.csv")
    elif rows:
        frame = rows_frame(rows.values())
    else:
        raise FileNotFoundError(f"{output_dir}: neither results.csv nor trials.jsonl here (give a sweep's folder)")
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
    return str(int(number)) if number is not None and number.is_integer() else ("" if number is None else str(value))


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


def _settings(frame: pd.DataFrame) -> dict[str, int]:
    """Each engine setting's colour index, in the table's order (the same colour in every figure)."""
    labels = [setting_label(r) for r in frame.sort_values(SETTING_KEYS, kind="stable").to_dict("records")]
    return {label: i for i, label in enumerate(dict.fromkeys(labels))}


def _colour(index: int) -> str:
    return f"C{index % 10}"


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
    hardware = [str(prov[k]) for k in ("hardware", "driver_gpus", "cluster", "cpu")
                if prov.get(k) and not (k == "driver_gpus" and prov[k] == "none")]
    memory, source = device_memory(sweep)
    if memory:
        hardware.append(f"{memory:.1f} GiB per device (from {source})")
    devices = (list(dict.fromkeys(sweep.per_rank["device_name"].dropna().astype(str)))
               if sweep.per_rank is not None and "device_name" in sweep.per_rank else [])
    if devices and not any(d in " ".join(hardware) for d in devices):
        hardware.append("ranks on " + ", ".join(devices))
    versions = prov.get("versions") if isinstance(prov.get("versions"), dict) else {}
    versions = {**{k: prov[k] for k in ("python", "torch", "deepspeed", "ray") if prov.get(k)}, **versions}
    shown = {"experiment", "question", "date", "command", "versions", "hardware", "driver_gpus", "cluster", "cpu",
             "gpu_memory_gib", "python", "torch", "deepspeed", "ray"}
    others = {k: v for k, v in prov.items() if k not in shown and _present(v) and v != ""}
    precisions = list(dict.fromkeys(frame["precision"].dropna().astype(str)))
    datasets = list(dict.fromkeys(frame["dataset"].dropna().astype(str)))
    return {
        "name": name, "question": question, "model": model_text,
        "training": ", ".join(filter(None, [", ".join(precisions), ", ".join(datasets),
                                            f"{_int_text(first.get('steps'))} steps" if first.get("steps") else ""])),
        "hardware": "; ".join(hardware) or "not recorded",
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()) or "not recorded",
        "date": prov.get("date") or "not recorded", "command": prov.get("command") or "",
        "others": others, "folder": sweep.folder.name, "is_fit": sweep.fit is not None,
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
        runner = group.sort_values("samples_per_s", ascending=False).iloc[1].to_dict() if len(group) > 1 else None
        memory = (f"peak resident set {_gib(winner['peak_allocated_gib_max'])} per worker, model states "
                  f"{_gib(winner['measured_model_state_gib'])}" if cpu else
                  f"peak {_gib(winner['peak_allocated_gib_max'])} per rank"
                  + (f" (predicted {_gib(winner['predicted_peak_gib'])})"
                     if _present(winner["predicted_peak_gib"]) else ""))
        speed = f"{fmt(winner['samples_per_s'])} samples/s"
        if _present(winner.get("mfu")):
            speed += f", MFU {_percent(float(winner['mfu']))}"
        lightest = group.sort_values("peak_allocated_gib_max").iloc[0].to_dict()
        best.append({
            "workers": _int_text(workers), "setting": setting_label(winner),
            "micro_batch": _int_text(winner["micro_batch_size"]), "trial": winner["trial"], "speed": speed,
            "memory": memory, "of": len(group),
            "runner_up": (f"next: {setting_label(runner)}, micro-batch {_int_text(runner['micro_batch_size'])}, "
                          f"{fmt(runner['samples_per_s'])} samples/s, {_gib(runner['peak_allocated_gib_max'])}")
            if runner else "",
            "lightest": (f"least memory: {setting_label(lightest)}, micro-batch "
                         f"{_int_text(lightest['micro_batch_size'])}, {_gib(lightest['peak_allocated_gib_max'])}, "
                         f"{fmt(lightest['samples_per_s'])} samples/s")
            if lightest["trial"] != winner["trial"] else "",
        })
    reasons = {}
    for record in frame[frame["status"].isin(NOT_OK)].to_dict("records"):
        reason = str(record.get("error") or "no reason recorded")
        reasons.setdefault((record["status"], reason), []).append(record["trial"])
    not_ok = [{"status": s, "reason": r, "trials": t} for (s, r), t in reasons.items()]
    return {"summary": summary, "best": best, "not_ok": not_ok, "fit_note": fit_note}


def table(frame: pd.DataFrame, columns: list[tuple[str, str, str]] = TABLE_COLUMNS,
          keep_constant: Iterable[str] = ("trial", "status", "stage", "num_workers", "micro_batch_size")):
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
            cells.append({"text": text, "sort": "" if not _present(value) else (
                repr(number) if number is not None else str(value)), "numeric": number is not None,
                "column": column, "title": title, "why": why})
        body.append({"status": str(record.get("status") or ""), "cells": cells, "trial": record.get("trial", "")})
    return {"columns": [{"key": c, "heading": h, "hint": t} for c, h, t in shown], "rows": body,
            "constant": constant}


# --------------------------------------------------------------------------------------------- figures

def _from_zero(axes: list) -> None:
    """y from 0 to a tenth above the highest point of any of `axes` (panels compared side by side: one
    scale, and room above the top marker)."""
    tops = [ax.dataLim.y1 for ax in axes if ax is not None and math.isfinite(ax.dataLim.y1)]
    top = max(tops, default=0.0)
    for ax in axes:
        if ax is not None:
            ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)


def legend_right(fig, handles: list, left_chars: Optional[int] = None) -> None:
    """The legend in a column to the right of the axes, as wide as its longest label, the axes laid out in
    the rest (no second drawing pass, as bbox_inches="tight" would make: a 50-row page stays fast).
    With `left_chars` (the longest tick label, at 7.5 points) the margins are set by arithmetic rather than
    by tight_layout's measuring of every label: the breakdown's many bars."""
    width_in, height_in = fig.get_figwidth(), fig.get_figheight()
    longest = max((len(h.get_label()) for h in handles), default=0)
    share = min(0.45, (0.75 + 0.06 * longest) / width_in)  # 8-point DejaVu Sans: about 0.06 in a character
    if left_chars is None:
        fig.tight_layout(rect=(0, 0, 1 - share, 1))
    else:
        fig.subplots_adjust(left=min(0.5, (0.3 + 0.064 * left_chars) / width_in), right=1 - share - 0.02,
                            bottom=0.5 / height_in, top=1 - 0.12 / height_in)
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1 - share + 0.005, 0.98), fontsize=8,
               frameon=False)

@dataclass
class Figure:
    id: str
    title: str
    caption: str
    svg: str = ""
    skipped: str = ""
    """The sentence shown instead, when the figure would have nothing to show."""
    kind: str = ""
    only: str = ""
    """Skipped for want of a second x value: where every trial ran ("with 1 worker", "at micro-batch 64")."""


class Figures:
    """Draws the page's figures as SVG strings; every marker tagged with an id and a hover title."""

    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        self.count = 0
        self.colours = _settings(sweep.frame)
        self.memory, self.memory_source = device_memory(sweep)
        self.shift = lambda x: x

    def new(self, title: str, caption: str, kind: str) -> Figure:
        self.count += 1
        return Figure(f"fig{self.count}", title, caption, kind=kind)

    def svg(self, fig, figure: Figure, titles: dict[str, str]) -> str:
        with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": figure.id, "font.size": 9}):
            buffer = io.StringIO()
            fig.savefig(buffer, format="svg", metadata={"Date": None})
        plt.close(fig)
        text = buffer.getvalue()
        text = text[text.index("<svg"):]  # drop the XML declaration and DOCTYPE: inline in HTML
        text = re.sub(r'<svg ([^>]*?)width="([\d.]+)pt" height="([\d.]+)pt"',
                      lambda m: f'<svg {m.group(1)}class="chart" role="img" aria-label="{html.escape(figure.title)}" '
                                f'style="max-width:{float(m.group(2)) * 4 / 3:.0f}px"', text, count=1)
        text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, count=1, flags=re.S)
        for gid, title in titles.items():  # the browser's hover text on each marker
            text = text.replace(f'<g id="{gid}">', f'<g id="{gid}"><title>{html.escape(title)}</title>', 1)
        return text

    # ---- memory and throughput against workers / micro-batch

    def _facets(self, rows: pd.DataFrame, axis: str, second: bool = False):
        """One panel per value of the other axis (up to 3 a row; "1 worker", "micro-batch 64"), each with
        a second, lower panel when `second` (MFU, or the model states of CPU rows). Panels of one row
        share their y axis. Returns the figure and (top, bottom or None, value, rows, title) per panel."""
        other = "micro_batch_size" if axis == "num_workers" else "num_workers"
        values = sorted(rows[other].dropna().unique())
        columns = min(3, len(values))
        blocks = (len(values) + columns - 1) // columns
        per_block = 2 if second else 1
        fig, axes = plt.subplots(blocks * per_block, columns, squeeze=False, sharey="row",
                                 sharex="col" if second else "none",
                                 gridspec_kw={"height_ratios": [3, 2] * blocks} if second else None,
                                 figsize=(9.6 if columns > 1 else 7.6, (5.8 if second else 3.6) * blocks))

        def title(value) -> str:
            if other == "micro_batch_size":
                return f"micro-batch {_int_text(value)}"
            return f"{_int_text(value)} worker" + ("" if _int_text(value) == "1" else "s")

        facets = []
        for index, value in enumerate(values):
            block, column = divmod(index, columns)
            top = axes[block * per_block, column]
            bottom = axes[block * per_block + 1, column] if second else None
            facets.append((top, bottom, value, rows[rows[other] == value], title(value)))
        for index in range(len(values), blocks * columns):  # the last row's empty places
            block, column = divmod(index, columns)
            for row in range(per_block):
                axes[block * per_block + row, column].set_visible(False)
        return fig, facets

    @staticmethod
    def _log_axis(axis: str, values: Iterable[float]) -> bool:
        values = sorted(set(values))
        return axis == "micro_batch_size" and bool(values) and values[-1] / max(values[0], 1) > 8

    def dodge(self, axis: str, values: Iterable[float], position: int, count: int) -> None:
        """Settings side by side: each setting's points moved a little along x (1.5% of the axis per
        setting), so that equal values at the same x stay visible. Ticks stay at the true values."""
        values = sorted(set(float(v) for v in values))
        step = (position - (count - 1) / 2) * 0.015
        if count < 2 or len(values) < 1:
            self.shift = lambda x: x
        elif self._log_axis(axis, values):
            factor = 2 ** (step * math.log2(values[-1] / values[0]))
            self.shift = lambda x: x * factor
        else:
            span = (values[-1] - values[0]) or 1.0
            self.shift = lambda x: x + step * span

    def _x_axis(self, ax, axis: str, values: Iterable[float]) -> None:
        values = sorted(set(values))
        if self._log_axis(axis, values):
            ax.set_xscale("log", base=2)
        ax.set_xticks(values)
        ax.set_xticklabels([_int_text(v) for v in values])
        ax.set_xlabel("workers (data-parallel ranks)" if axis == "num_workers" else "micro-batch size per rank")
        ax.grid(alpha=0.3)

    def _points(self, ax, group: pd.DataFrame, axis: str, column: str, role: str, figure: Figure,
                titles: dict, colour: str, style: str, marker: str, describe, hollow: bool = False,
                scale: float = 1.0) -> int:
        """A line through a setting's points and one tagged marker per row (y = the column × `scale`); the
        number of markers drawn."""
        drawn = group[group[column].notna()].sort_values(axis)
        if len(drawn) > 1:
            ax.plot([self.shift(x) for x in drawn[axis]], drawn[column] * scale, style, color=colour,
                    alpha=0.8 if style == "--" else 1.0)
        for record in drawn.to_dict("records"):
            gid = f"{figure.id}--{role}--{record['trial']}"
            (marker_line,) = ax.plot([self.shift(record[axis])], [record[column] * scale], marker, color=colour,
                                     markersize=8 if hollow else 6, markerfacecolor="none" if hollow else colour,
                                     linestyle="none", zorder=2.5 if hollow else 3)
            marker_line.set_gid(gid)
            titles[gid] = describe(record)
        return len(drawn)

    def against(self, axis: str, what: str, kind: str) -> Figure:
        """Memory (what="memory") or throughput (what="speed") of one memory kind against `axis`.

        GPU memory: the measured peak (solid, filled) and the predicted (dashed, hollow), out-of-memory
        trials as × at the memory they held, the device's memory dotted. CPU memory: the resident set
        above, the model states counted and predicted below (on its own scale: megabytes beside the
        resident set's gigabytes). Throughput: samples/s above, MFU below on GPU."""
        frame = self.sweep.frame[self.sweep.frame["memory_kind"].fillna("cuda") == kind]
        ok = frame[frame["status"] == "ok"]
        oom = frame[frame["status"] == "oom"] if what == "memory" else frame.iloc[0:0]
        gpu, memory = kind == "cuda", what == "memory"
        axis_words = "workers" if axis == "num_workers" else "micro-batch size"
        device = "GPU" if gpu else "CPU"
        if memory:
            title = f"Memory per rank against {axis_words} ({device})"
            caption = ("Peak CUDA memory allocated per rank, max over ranks: measured (solid, filled) against the "
                       "memory model's prediction (dashed, hollow); × marks an out-of-memory trial at the memory "
                       "it held when it failed." if gpu else
                       "Above, each worker process's peak resident set (Python, torch and Ray included: not "
                       "comparable with GPU memory). Below, on its own scale, the model states counted tensor by "
                       "tensor (solid) and what the memory model predicts for them (dashed, hollow).")
        else:
            title = f"Throughput against {axis_words} ({device})"
            caption = "Samples per second over the timed steps, summed over ranks" + (
                "; below, model FLOPs utilisation (MFU), mean over ranks." if gpu else ".")
        figure = self.new(title, caption, f"{what}-{axis}")
        plotted = pd.concat([ok, oom])
        if plotted.empty:
            figure.skipped = f"No {device} trial finished: nothing to draw against {axis_words}."
            return figure
        if plotted[axis].nunique() < 2:
            only = _int_text(plotted[axis].iloc[0])
            figure.only = ((f"with {only} worker" + ("" if only == "1" else "s")) if axis == "num_workers"
                           else f"at micro-batch {only}")
            figure.skipped = (f"Every {device} trial ran {figure.only}: nothing to draw against {axis_words}; "
                              "the table and the breakdown compare them.")
            return figure
        second = (not gpu and memory and ok["measured_model_state_gib"].notna().any()) or (
            gpu and not memory and ok["mfu"].notna().any())
        fig, facets = self._facets(plotted, axis, second)
        titles: dict[str, str] = {}
        used: list[str] = []
        present = [label for label, _ in self._by_setting(plotted)]
        for top, bottom, _, group, facet_title in facets:
            for label, setting in self._by_setting(group):
                colour = _colour(self.colours.get(label, 0))
                used.append(label)
                self.dodge(axis, plotted[axis], present.index(label), len(present))
                done = setting[setting["status"] == "ok"]
                if memory:
                    self._points(top, done, axis, "peak_allocated_gib_max", "measured", figure, titles, colour, "-",
                                 "o", lambda r: f"{r['trial']}: {'peak' if gpu else 'peak resident set'} "
                                                f"{_gib(r['peak_allocated_gib_max'])} measured")
                    if gpu:
                        self._points(top, done, axis, "predicted_peak_gib", "predicted", figure, titles, colour, "--",
                                     "s", lambda r: f"{r['trial']}: peak {_gib(r['predicted_peak_gib'])} predicted",
                                     hollow=True)
                    elif bottom is not None:
                        self._points(bottom, done, axis, "measured_model_state_gib", "states", figure, titles,
                                     colour, "-", "^", lambda r: f"{r['trial']}: model states "
                                     f"{float(r['measured_model_state_gib']) * 1024:.3f} MiB counted", scale=1024)
                        self._points(bottom, done, axis, "predicted_model_state_gib", "predicted", figure, titles,
                                     colour, "--", "^", lambda r: f"{r['trial']}: model states "
                                     f"{float(r['predicted_model_state_gib']) * 1024:.3f} MiB predicted", hollow=True,
                                     scale=1024)
                    self._failures(top, setting, axis, figure, titles, colour)
                else:
                    self._points(top, done, axis, "samples_per_s", "measured", figure, titles, colour, "-", "o",
                                 lambda r: f"{r['trial']}: {fmt(r['samples_per_s'])} samples/s")
                    if bottom is not None:
                        self._points(bottom, done, axis, "mfu", "mfu", figure, titles, colour, "-", "D",
                                     lambda r: f"{r['trial']}: MFU {_percent(float(r['mfu']))}")
            if memory and gpu and self.memory:
                top.axhline(self.memory, color="black", linestyle=":", linewidth=1)
            top.set_title(facet_title, fontsize=9)
            for ax in (top, bottom):
                if ax is not None:
                    self._x_axis(ax, axis, plotted[axis])
            if bottom is not None:
                top.set_xlabel("")
                top.tick_params(labelbottom=False)
                if not memory:
                    bottom.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=0))
        _from_zero([f[0] for f in facets])
        _from_zero([f[1] for f in facets])
        for top, bottom, *_ in facets:
            if top.get_subplotspec().colspan.start == 0:
                top.set_ylabel(("peak CUDA allocated per rank (GiB)" if gpu else "peak resident set per worker (GiB)")
                               if memory else "samples/s, all ranks")
                if bottom is not None:
                    bottom.set_ylabel("model states per rank (MiB)" if memory else "MFU")
        legend_right(fig, self._legend(used, memory, gpu, oom_shown=len(oom) > 0))
        figure.svg = self.svg(fig, figure, titles)
        if memory and gpu:
            figure.caption += (f" Dotted: the device's {self.memory:.1f} GiB (from {self.memory_source})."
                               if self.memory else
                               " The device's memory is not recorded in this folder: no line for it.")
        return figure

    def _failures(self, ax, setting: pd.DataFrame, axis: str, figure: Figure, titles: dict, colour: str) -> None:
        """× for each out-of-memory trial, at the memory it held when it failed (else at the device's)."""
        for record in setting[setting["status"] == "oom"].to_dict("records"):
            y = _number(record["peak_allocated_gib_max"]) or self.memory
            if y is None:
                continue
            gid = f"{figure.id}--oom--{record['trial']}"
            (line,) = ax.plot([self.shift(record[axis])], [y], "X", color=colour, markersize=9, linestyle="none",
                              markeredgecolor="black", markeredgewidth=0.6, zorder=3)
            line.set_gid(gid)
            titles[gid] = f"{record['trial']}: out of memory at {_gib(y)}"

    def _legend(self, used: list[str], memory: bool, gpu: bool, oom_shown: bool) -> list:
        handles = [Line2D([], [], color=_colour(self.colours[label]), linewidth=6, label=label)
                   for label in self.colours if label in used]
        if not memory:
            return handles
        if gpu:
            handles += [Line2D([], [], color="gray", marker="o", label="measured peak"),
                        Line2D([], [], color="gray", marker="s", markerfacecolor="white", linestyle="--",
                               label="predicted peak")]
        else:
            handles += [Line2D([], [], color="gray", marker="o", label="peak resident set (RSS), measured"),
                        Line2D([], [], color="gray", marker="^", label="model states, counted"),
                        Line2D([], [], color="gray", marker="^", markerfacecolor="white", linestyle="--",
                               label="model states, predicted")]
        if oom_shown:
            handles.append(Line2D([], [], color="gray", marker="X", linestyle="none", markeredgecolor="black",
                                  label="out of memory (memory at failure)"))
        if gpu and self.memory:
            handles.append(Line2D([], [], color="black", linestyle=":", label=f"device memory {self.memory:.1f} GiB"))
        return handles

    def _by_setting(self, rows: pd.DataFrame):
        labels = rows.apply(setting_label, axis=1) if len(rows) else pd.Series(dtype=str)
        for label in self.colours:
            group = rows[labels == label]
            if len(group):
                yield label, group

    # ---- where the memory went

    def _measured_ranks(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Each rank's components (bytes) for one trial: per_rank.csv, else the row's max over ranks."""
        per_rank = self.sweep.per_rank
        ranks = []
        if per_rank is not None and len(per_rank):
            for rank in per_rank[per_rank["trial"] == record["trial"]].sort_values("rank").to_dict("records"):
                ranks.append({"label": f"rank {_int_text(rank.get('rank'))}", **rank})
        if not ranks:
            aggregate = {key: record.get(f"{key}_per_rank_max") for key, _, _ in COMPONENTS[:4]}
            aggregate["saved_for_backward_bytes"] = record.get("saved_for_backward_bytes_per_rank_max")
            ranks.append({"label": "max over ranks", "peak_allocated_gib": record.get("peak_allocated_gib_max"),
                          **aggregate})
        return ranks

    def _measured_bar(self, rank: dict[str, Any], cpu: bool) -> tuple[dict[str, float], str]:
        parts = {key: (_number(rank.get(key)) or 0.0) for key, _, _ in COMPONENTS[:4]}
        states = sum(parts.values())
        peak = _number(rank.get("peak_allocated_gib"))
        if cpu or peak is None:
            return parts, ""
        peak *= GIB
        saved = _number(rank.get("saved_for_backward_bytes"))
        if saved is not None:
            parts["activation_bytes"] = saved
            parts["rest_bytes"] = max(peak - states - saved, 0.0)
            return parts, ""
        parts["unsplit_bytes"] = max(peak - states, 0.0)
        return parts, "unsplit"

    def _predicted_bar(self, record: dict[str, Any]) -> tuple[Optional[dict[str, float]], str]:
        """The memory model's components for a trial, and what its 'rest' is made of (hover text)."""
        row = self.sweep.rows.get(record["trial"], record)
        try:
            prediction = predict_point(row, self.sweep.calibration)
        except (KeyError, TypeError, ValueError):
            return None, ""
        parts = {key: float(getattr(prediction, key)) for key, _, _ in COMPONENTS[:4]}
        rest = ""
        if prediction.peak_bytes is not None:
            activations = float(prediction.activation_bytes or 0.0)
            parts["activation_bytes"] = activations
            parts["rest_bytes"] = max(prediction.peak_bytes - prediction.model_state_bytes - activations, 0.0)
            terms = [f"{words} {_gib(getattr(prediction, key) / GIB, 3)}" for key, words in PREDICTED_REST
                     if getattr(prediction, key)]
            step_wins = prediction.step_transient_bytes > activations + prediction.compute_bytes
            rest = (" (" + ", ".join(terms) + "; the step's temporaries "
                    + ("outlast" if step_wins else "come after") + " the activations)") if terms else ""
        return parts, rest

    def breakdown(self) -> list[Figure]:
        """A stacked bar per rank of each ok trial, and the prediction: one figure for a few trials, else one
        per engine setting."""
        sweep = self.sweep
        ok = sweep.frame[sweep.frame["status"] == "ok"]
        if ok.empty:
            figure = self.new("Where the memory went", "", "breakdown")
            figure.skipped = "No trial finished (status ok): no peak to break down."
            return [figure]
        figures = []
        groups = []
        for kind, rows in ok.groupby(ok["memory_kind"].fillna("cuda"), sort=True):
            rows = rows.sort_values(SETTING_KEYS + ["num_workers", "micro_batch_size"], kind="stable")
            if len(rows) <= 6:  # a few trials: one figure, settings side by side
                groups.append(("", rows))
            else:
                groups += list(self._by_setting(rows))
        for label, group in groups:
            cpu = set(group["memory_kind"].dropna()) == {"cpu_rss"}
            figure = self.new("Where the memory went" + (f": {label}" if label else ""), "", "breakdown")
            bars, spreads = [], []
            for record in group.to_dict("records"):
                ranks = self._measured_ranks(record)
                peaks = [(_number(r.get("peak_allocated_gib")), r) for r in ranks]
                if len(ranks) > 4:  # many ranks: the lowest and highest peak stand for them
                    known = sorted([p for p in peaks if p[0] is not None], key=lambda p: p[0])
                    if known:
                        ranks = [dict(known[0][1], label=known[0][1]["label"] + " (lowest peak)"),
                                 dict(known[-1][1], label=known[-1][1]["label"] + " (highest peak)")]
                values = [p for p, _ in peaks if p is not None]
                if len(values) > 1:
                    spreads.append((max(values) - min(values), f"{record['trial']}: {min(values):.2f}–"
                                    f"{max(values):.2f} GiB over {len(values)} ranks"))
                for rank in ranks:
                    parts, _ = self._measured_bar(rank, cpu)
                    bars.append((f"{record['trial']} · {rank['label']}", parts, record["trial"],
                                 rank["label"].split(" (")[0].replace(" ", ""), False, ""))
                predicted, rest = self._predicted_bar(record)
                if predicted is not None:
                    bars.append((f"{record['trial']} · predicted", predicted, record["trial"], "predicted", True,
                                 rest))
            fig, ax = plt.subplots(figsize=(9.6, 0.8 + 0.3 * len(bars)))
            titles: dict[str, str] = {}
            positions = list(range(len(bars)))[::-1]
            used = set()
            lefts = [0.0] * len(bars)
            largest = max((sum(v for v in bar[1].values() if v) for bar in bars), default=0.0)
            unit, unit_name = (GIB, "GiB") if largest >= GIB / 2 else (1024 ** 2, "MiB")  # a seed model: MiB
            for key, words, colour in COMPONENTS:  # one barh per component and kind: fast for many rows
                for is_prediction in (False, True):
                    chosen = [(i, y) for i, (y, bar) in enumerate(zip(positions, bars))
                              if bar[4] is is_prediction and bar[1].get(key) is not None]
                    if not chosen:
                        continue
                    used.add(key)
                    widths = [bars[i][1][key] / unit for i, _ in chosen]
                    drawn = ax.barh([y for _, y in chosen], widths, left=[lefts[i] for i, _ in chosen], height=0.72,
                                    color=colour, hatch="//" if is_prediction else None, linewidth=0.5,
                                    edgecolor="#444" if is_prediction else "white")
                    for (i, _), width, rect in zip(chosen, widths, drawn.patches):
                        name, _, trial, who, _, rest = bars[i]
                        gid = f"{figure.id}--{'predicted' if is_prediction else 'measured'}--{trial}--{who}--{key}"
                        rect.set_gid(gid)
                        titles[gid] = (f"{name}: {words} {width:.3f} {unit_name}"
                                       + (rest if key == "rest_bytes" else ""))
                        lefts[i] += width
            for y, total in zip(positions, lefts):
                ax.text(total, y, f" {total:.2f}", va="center", fontsize=7)
            trials = list(dict.fromkeys(b[2] for b in bars))
            for y, bar in zip(positions, bars):  # a light band behind every other trial's bars
                if trials.index(bar[2]) % 2:
                    ax.axhspan(y - 0.5, y + 0.5, color="#eef1f4", zorder=0, linewidth=0)
            ax.set_ylim(-0.6, len(bars) - 0.4)
            ax.set_yticks(positions)
            ax.set_yticklabels([b[0] for b in bars], fontsize=7.5)
            ax.set_xlabel(f"{unit_name} per rank" + (" (model states only: CPU)" if cpu else ""))
            ax.grid(axis="x", alpha=0.3)
            ax.margins(x=0.08)
            if self.memory and not cpu:  # the device's memory, where it is near enough to read beside the bars
                device = self.memory * GIB / unit
                if device < ax.get_xlim()[1] * 1.5:
                    ax.axvline(device, color="black", linestyle=":", linewidth=1)
            legend = [Patch(facecolor=c, label=w) for k, w, c in COMPONENTS if k in used]
            legend.append(Patch(facecolor="white", edgecolor="#444", hatch="//", label="predicted (memory model)"))
            legend_right(fig, legend, left_chars=max(len(b[0]) for b in bars))
            figure.svg = self.svg(fig, figure, titles)
            figure.caption = (
                "Per rank, the model states counted tensor by tensor after the first step (parameters, gradients, "
                "fp32 master weights, optimizer states) stacked to the measured peak; hatched, the memory model's "
                "components of its predicted peak (its 'rest': communication buckets, workspaces, this rank's data, "
                "the step's temporaries and gathered parameters)." if not cpu else
                "CPU rows: the model states counted tensor by tensor per rank against the memory model's; the peak "
                "resident set (Python, torch and Ray included) is not broken down.")
            if "unsplit_bytes" in used:
                figure.caption += (" This folder's rows do not record the bytes saved for backward: the lilac part "
                                   "is the peak less the model states (activations, buckets, temporaries together).")
            if spreads:  # the widest three
                spreads.sort(key=lambda item: -item[0])
                figure.caption += (" The peak over ranks, widest spread first: "
                                   + "; ".join(text for _, text in spreads[:3])
                                   + (f" (and {len(spreads) - 3} more trials)" if len(spreads) > 3 else "") + ".")
            figures.append(figure)
        return figures

    # ---- fit

    def fit_probes(self) -> Figure:
        sweep = self.sweep
        frame = sweep.frame
        probes = frame[~frame["trial"].str.endswith("_timed")]
        budget = _number(sweep.fit["budget_gib"].dropna().iloc[0]) if sweep.fit["budget_gib"].notna().any() else None
        figure = self.new("Fit: the probes", (
            "Every probe is a short trial at one micro-batch: its measured peak per rank (circles) or an "
            "out-of-memory failure (×, at the memory it held, else at the budget); the dashed line is the budget, "
            "the star each setting's largest micro-batch that fits. The timed reruns (trials ending in _timed) "
            "are in the table."), "fit-probes")
        if probes.empty or len(probes) < 2:
            figure.skipped = "Fewer than two probes: nothing to draw; the fit table says what was found."
            return figure
        fig, facets = self._facets(probes, "micro_batch_size")
        titles: dict[str, str] = {}
        used = set()
        present = [label for label, _ in self._by_setting(probes)]
        for ax, _, workers, group, facet_title in facets:
            for label, setting in self._by_setting(group):
                used.add(label)
                self.dodge("micro_batch_size", probes["micro_batch_size"], present.index(label), len(present))
                colour = _colour(self.colours.get(label, 0))
                done = setting[setting["status"] == "ok"]
                self._points(ax, done, "micro_batch_size", "peak_allocated_gib_max", "probe", figure, titles,
                             colour, "-", "o",
                             lambda r: f"{r['trial']}: fits, peak {_gib(r['peak_allocated_gib_max'])}")
                for record in setting[setting["status"] != "ok"].to_dict("records"):
                    y = _number(record["peak_allocated_gib_max"]) or budget
                    if y is None:
                        continue
                    gid = f"{figure.id}--oom--{record['trial']}"
                    (line,) = ax.plot([self.shift(record["micro_batch_size"])], [y], "X", color=colour, markersize=9,
                                      markeredgecolor="black", markeredgewidth=0.6, linestyle="none")
                    line.set_gid(gid)
                    titles[gid] = f"{record['trial']}: {record['status']} ({str(record.get('error') or '')[:120]})"
                found = sweep.fit[(sweep.fit["num_workers"] == workers) & sweep.fit["max_micro_batch"].notna()]
                for answer in found.to_dict("records"):
                    if setting_label(answer) != label:
                        continue
                    match = done[done["micro_batch_size"] == answer["max_micro_batch"]]
                    y = _number(answer.get("peak_gib")) or (
                        _number(match["peak_allocated_gib_max"].iloc[0]) if len(match) else None)
                    if y is not None:
                        ax.plot([self.shift(answer["max_micro_batch"])], [y], "*", color=colour, markersize=22,
                                alpha=0.45, markeredgecolor="black", markeredgewidth=0.6, linestyle="none", zorder=1.5)
            if budget:
                ax.axhline(budget, color="firebrick", linestyle="--", linewidth=1)
            ax.set_title(facet_title, fontsize=9)
            self._x_axis(ax, "micro_batch_size", group["micro_batch_size"])
        _from_zero([f[0] for f in facets])
        facets[0][0].set_ylabel("peak per rank (GiB)")
        handles = [Line2D([], [], color=_colour(self.colours[label]), linewidth=6, label=label)
                   for label in self.colours if label in used]
        handles += [Line2D([], [], color="gray", marker="o", label="probe fits"),
                    Line2D([], [], color="gray", marker="X", linestyle="none", markeredgecolor="black",
                           label="probe out of memory"),
                    Line2D([], [], color="gray", marker="*", markersize=12, linestyle="none",
                           label="largest that fits")]
        if budget:
            handles.append(Line2D([], [], color="firebrick", linestyle="--", label=f"budget {budget:.2f} GiB"))
        legend_right(fig, handles)
        figure.svg = self.svg(fig, figure, titles)
        return figure

    def fit_maxima(self) -> Figure:
        fit = self.sweep.fit
        figure = self.new("Fit: the largest micro-batch that fits", (
            "Per (setting, workers): the largest micro-batch whose measured peak stayed within the budget, and "
            "the samples/s of its timed run."), "fit-maxima")
        found = fit[fit["max_micro_batch"].notna()]
        if len(found) < 2:
            figure.skipped = ("One (setting, workers) point found a fitting micro-batch: the fit table says it all."
                              if len(found) else "No point found a micro-batch that fits within the budget.")
            return figure
        fig, (size, speed) = plt.subplots(1, 2, figsize=(9.2, 0.9 + 0.32 * len(found)), sharey=True)
        names, titles = [], {}
        records = found.sort_values(SETTING_KEYS[:2] + ["num_workers"], kind="stable").to_dict("records")
        for y, record in zip(range(len(records))[::-1], records):
            label = setting_label(record)
            colour = _colour(self.colours.get(label, 0))
            workers = _int_text(record["num_workers"])
            names.append((y, f"{label}, {workers} worker" + ("" if workers == "1" else "s")))
            key = f"{label.replace(' ', '_')}_w{_int_text(record['num_workers'])}"
            (bar,) = size.barh(y, record["max_micro_batch"], color=colour, height=0.7)
            bar.set_gid(f"{figure.id}--max--{key}")
            titles[f"{figure.id}--max--{key}"] = f"{names[-1][1]}: micro-batch {_int_text(record['max_micro_batch'])}"
            size.text(record["max_micro_batch"], y, f" {_int_text(record['max_micro_batch'])}", va="center", fontsize=7)
            if _present(record.get("samples_per_s")):
                speed.barh(y, record["samples_per_s"], color=colour, height=0.7)
                speed.text(record["samples_per_s"], y, f" {fmt(record['samples_per_s'])}", va="center", fontsize=7)
        size.set_yticks([y for y, _ in names])
        size.set_yticklabels([n for _, n in names], fontsize=8)
        size.set_xlabel("largest micro-batch that fits")
        speed.set_xlabel("samples/s at it, all ranks")
        for ax in (size, speed):
            ax.grid(axis="x", alpha=0.3)
            ax.margins(x=0.15)
        fig.tight_layout()
        figure.svg = self.svg(fig, figure, titles)
        return figure


# --------------------------------------------------------------------------------------------- the page

def render_html(output_dir: Path) -> str:
    """The page's HTML for one output folder (see the module's docstring for what it reads). The same folder
    gives the same bytes: no build time or date of its own on the page, SVG ids salted per figure."""
    sweep = read_sweep(Path(output_dir))
    figures = Figures(sweep)
    sections = []
    kinds = [k for k in ("cuda", "cpu_rss") if (sweep.frame["memory_kind"].fillna("cuda") == k).any()]
    for kind in kinds:
        device = "GPU" if kind == "cuda" else "CPU"
        for title, what in (("Memory", "memory"), ("Throughput", "speed")):
            sections.append({"title": title, "device": device, "figures": [
                figures.against("num_workers", what, kind), figures.against("micro_batch_size", what, kind)]})
    for section in sections:  # both figures of a section skipped for want of a second x: one sentence
        workers, batch = section["figures"]
        if workers.only and batch.only:
            workers.skipped = (f"Every {section['device']} trial ran {workers.only} and {batch.only}: no line to "
                               "draw against workers or micro-batch size; the table and the breakdown compare them.")
            workers.title = f"{section['title']} against workers and micro-batch size ({section['device']})"
            section["figures"] = [workers]
    sections.append({"title": "Where the memory went", "figures": figures.breakdown()})
    fit_table, fit_figures = None, []
    if sweep.fit is not None:
        fit_figures = [figures.fit_maxima(), figures.fit_probes()]
        fit_columns = [(c, c.replace("_", " "), c) for c in sweep.fit.columns]
        fit_table = table(sweep.fit, fit_columns, keep_constant=[c for c, _, _ in fit_columns])
    frame = sweep.frame.sort_values(SORT_KEYS, kind="stable") if len(sweep.frame) else sweep.frame
    from ray_zero.report import memory_note

    environment = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html", "j2"]),
                              trim_blocks=True, lstrip_blocks=True)
    page = environment.get_template("report.html.j2").render(
        header=header(sweep), headline=headline(sweep), table=table(frame), fit_table=fit_table,
        fit_figures=fit_figures, sections=sections, memory_note=memory_note(sweep.frame).replace("`", ""),
        trials=len(sweep.frame))
    return page


def write_html_report(output_dir: Path) -> Path:
    """Write OUTPUT_DIR/report.html (atomically) from the folder's tables; return its path."""
    output_dir = Path(output_dir)
    path = output_dir / REPORT_FILE
    atomic_write(path, render_html(output_dir))
    return path


def main(argv: Optional[list[str]] = None) -> None:
    """python -m ray_zero.html_report DIR...: (re)write each folder's report.html."""
    import sys

    for folder in (argv if argv is not None else sys.argv[1:]):
        print(write_html_report(Path(folder)))


if __name__ == "__main__":
    main()
