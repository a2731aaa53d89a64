"""report.html: one self-contained page of a sweep (or fit) folder, for people rather than scripts.

    from ray_zero.report.page import write_html_report
    write_html_report(Path("results/memory_scaling-h200x2"))   # -> results/memory_scaling-h200x2/report.html

The page is templates/report.html.j2 filled in with the folder's data (data.py: what it reads; summary.py:
the header and headline) and its figures (figures.py and the modules it names). The same drawings go beside
it as the PNG files a user attaches to a report (FIGURE_FILES). `python -m ray_zero report DIR` writes them
again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from jinja2 import Environment, FileSystemLoader, select_autoescape

from ray_zero.report.against import AgainstFigures
from ray_zero.report.breakdown import BreakdownFigures
from ray_zero.report.data import REPORT_FILE, Sweep, read_sweep, table
from ray_zero.report.fit_figures import FitFigures
from ray_zero.report.frame import memory_note, with_record_columns
from ray_zero.report.speed_estimate import folder_speed
from ray_zero.report.step_figures import StepFigures
from ray_zero.report.summary import header, headline
from ray_zero.rows import SORT_KEYS
from ray_zero.store import atomic_write, read_experiment_file

TEMPLATES = Path(__file__).parent / "templates"


FIGURE_FILES = {
    "memory.png": ("memory-num_workers", "memory-micro_batch_size"),
    "throughput.png": ("speed-num_workers", "speed-micro_batch_size"),
    "batch.png": ("memory-micro_batch_size",),
    "fit.png": ("fit-maxima",),
}
"""The PNG files beside the page: each the first of the page's figures of these kinds that it drew.
memory.png and throughput.png (against workers; where one worker count ran, against micro-batch size) and
fit.png are written whenever a trial finished (a fit found a micro-batch): drawn for the file alone where
the page says a sentence instead (one point per setting, one maximum); batch.png where the page draws it."""


class PageFigures(AgainstFigures, BreakdownFigures, FitFigures, StepFigures):
    """Every figure of the page, numbered in the order they are drawn."""


def render_html(output_dir: Path) -> str:
    """The page's HTML for one output folder (data.py's docstring says what it reads). The same folder
    gives the same bytes: no build time or date of its own on the page, SVG ids salted per figure."""
    return render(output_dir)[0]


def render(output_dir: Path, figure_rows: Optional[int] = None) -> tuple[str, dict[str, bytes]]:
    """The page's HTML and its figure files (FIGURE_FILES: PNG bytes by file name). With `figure_rows`,
    the figures are drawn from at most that many rows (a page drawn while a sweep runs); the tables hold
    every row."""
    sweep = read_sweep(Path(output_dir))
    drawn_from = _thinned(sweep, figure_rows)
    figures = PageFigures(drawn_from, png_kinds=[k for kinds in FIGURE_FILES.values() for k in kinds])
    sections = []
    kinds = [k for k in ("cuda", "cpu_rss") if (sweep.frame["memory_kind"].fillna("cuda") == k).any()]
    for kind in kinds:
        device = "GPU" if kind == "cuda" else "CPU"
        for title, what in (("Memory", "memory"), ("Throughput", "speed")):
            sections.append(
                {
                    "title": title,
                    "device": device,
                    "figures": [
                        figures.against("num_workers", what, kind),
                        figures.against("micro_batch_size", what, kind),
                    ],
                }
            )
    for section in sections:  # both figures of a section skipped for want of a second x: one sentence
        workers, batch = section["figures"]
        if workers.only and batch.only:
            workers.skipped = (
                f"Every {section['device']} trial ran {workers.only} and {batch.only}: no line to "
                "draw against workers or micro-batch size; the table and the breakdown compare them."
            )
            workers.title = f"{section['title']} against workers and micro-batch size ({section['device']})"
            section["figures"] = [workers]
    sections.append({"title": "Where the memory went", "figures": figures.breakdown()})
    sections.append({"title": "Where a step's time went", "figures": [figures.step_split()]})
    fit_table, fit_figures = None, []
    if sweep.fit is not None:
        fit_figures = [figures.fit_maxima(), figures.fit_probes()]
        fit_columns = [(c, c.replace("_", " "), c) for c in sweep.fit.columns]
        fit_table = table(sweep.fit, fit_columns, keep_constant=[c for c, _, _ in fit_columns])
    speed_note, speed_table = None, None
    speed = folder_speed(sweep.folder, list(sweep.rows.values()), read_experiment_file(sweep.folder))
    if speed is not None:
        speed_note, frame = speed
        speed_columns = [(c, c.replace("_", " "), c) for c in frame.columns]
        speed_table = table(frame.round(4), speed_columns, keep_constant=[c for c, _, _ in speed_columns])
    frame = sweep.frame.sort_values(SORT_KEYS, kind="stable") if len(sweep.frame) else sweep.frame
    frame = with_record_columns(frame, sweep.rows.values(), "page")  # the predicted speed, where rows have it
    environment = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(["html", "j2"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    page = environment.get_template("report.html.j2").render(
        header=header(sweep),
        headline=headline(sweep),
        table=table(frame),
        fit_table=fit_table,
        fit_figures=fit_figures,
        speed_table=speed_table,
        speed_note=speed_note,
        sections=sections,
        memory_note=memory_note(sweep.frame).replace("`", ""),
        trials=len(sweep.frame),
        figures_note=(
            f"While the sweep runs, the figures are drawn from {len(drawn_from.frame)} of its "
            f"{len(sweep.frame)} trials, spread over the table's order; at its end, from every trial."
            if drawn_from is not sweep
            else ""
        ),
        loggers=_loggers(sweep.folder),
    )
    drawn = [f for section in sections for f in section["figures"]] + fit_figures
    return page, _figure_files(figures, drawn, kinds)


def _thinned(sweep: Sweep, most: Optional[int]) -> Sweep:
    """`sweep` with at most `most` of its rows, evenly spread over the table's order (SORT_KEYS), and
    their ranks: a page's figures then cost the same however many rows came. `sweep` itself where it has
    no more."""
    if most is None or len(sweep.frame) <= most:
        return sweep
    ordered = sweep.frame.sort_values(SORT_KEYS, kind="stable")
    last = len(ordered) - 1
    picked = sorted({round(i * last / max(most - 1, 1)) for i in range(most)})
    frame = ordered.iloc[picked]
    per_rank = sweep.per_rank
    if per_rank is not None:
        per_rank = per_rank[per_rank["trial"].isin(set(frame["trial"]))]
    return dataclasses.replace(sweep, frame=frame, per_rank=per_rank)


def _figure_files(figures: PageFigures, drawn: list, memory_kinds: list[str]) -> dict[str, bytes]:
    """FIGURE_FILES from the page's figures (GPU before CPU), the files always written drawn for themselves
    where the page skipped theirs."""
    sweep, files = figures.sweep, {}
    if not (sweep.frame["status"] == "ok").any():
        return files
    for name, kinds in FIGURE_FILES.items():
        png = next((f.png for kind in kinds for f in drawn if f.kind == kind and f.png), b"")
        if not png and name == "fit.png" and sweep.fit is not None:
            png = figures.fit_maxima(even_one=True).png
        elif not png and name in ("memory.png", "throughput.png"):
            what = kinds[0].split("-")[0]
            png = figures.against("num_workers", what, memory_kinds[0], even_one=True).png
        if png:
            files[name] = png
    return files


def _loggers(folder: Path) -> dict:
    """Where runtime.loggers wrote (loggers.json, ray_zero/run/loggers.py), for the page's links."""
    import json

    path = Path(folder) / "loggers.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def write_html_report(output_dir: Path, figure_rows: Optional[int] = None) -> Path:
    """Write OUTPUT_DIR/report.html (atomically) and its figure files from the folder's tables; return the
    page's path. `figure_rows`: as for render."""
    output_dir = Path(output_dir)
    path = output_dir / REPORT_FILE
    page, files = render(output_dir, figure_rows)
    atomic_write(path, page)
    for name, png in files.items():
        (output_dir / name).write_bytes(png)
    return path
