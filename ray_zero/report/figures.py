"""The report's figures' common ground: `Figure`, and `Figures`, the drawing every figure shares (SVG
output, the PNG files beside it, panels, axes, one colour per engine setting, the legend beside the axes).

One family draws every figure: the page shows it as inline SVG (no script: it prints as sharp vectors and
each marker carries an SVG <title>, the browser's hover text), and the figures a user attaches to a report
(memory.png, throughput.png, batch.png, fit.png: page.FIGURE_FILES) are the same drawings as PNG. Why
matplotlib and not Plotly: docs/design.md. Each drawn marker has an id naming its figure, its role and its
trial (`fig3--measured--stage1_mb64_w2`), so a test counts them in the rendered page.

The figures themselves: against.py (memory and throughput against workers and micro-batch size),
breakdown.py (where the memory went), fit_figures.py (a fit's probes and maxima) and step_figures.py
(where a step's time went).
"""

from __future__ import annotations

import html
import io
import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters or CI
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from ray_zero.report.data import Sweep  # noqa: E402
from ray_zero.report.formatting import SETTING_KEYS, int_text, setting_label  # noqa: E402
from ray_zero.report.summary import device_memory  # noqa: E402

PNG_DPI = 120


def _settings(frame: pd.DataFrame) -> dict[str, int]:
    """Each engine setting's colour index, in the table's order (the same colour in every figure)."""
    labels = [setting_label(r) for r in frame.sort_values(SETTING_KEYS, kind="stable").to_dict("records")]
    return {label: i for i, label in enumerate(dict.fromkeys(labels))}


def colour_of(index: int) -> str:
    return f"C{index % 10}"


def from_zero(axes: list) -> None:
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
        fig.subplots_adjust(
            left=min(0.5, (0.3 + 0.064 * left_chars) / width_in),
            right=1 - share - 0.02,
            bottom=0.5 / height_in,
            top=1 - 0.12 / height_in,
        )
    fig.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1 - share + 0.005, 0.98), fontsize=8, frameon=False
    )


def cross_handle(label: str) -> Line2D:
    """The legend's entry for the × of a failed trial."""
    return Line2D([], [], color="gray", marker="X", linestyle="none", markeredgecolor="black", label=label)


def hollow_handle(marker: str, label: str) -> Line2D:
    """The legend's entry for a prediction: dashed, hollow markers."""
    return Line2D([], [], color="gray", marker=marker, markerfacecolor="white", linestyle="--", label=label)


class Series(NamedTuple):
    """What a setting draws of one column: a line and a tagged marker per row."""

    column: str
    role: str
    """The markers' role in their ids (FIGURE--ROLE--TRIAL)."""
    style: str
    marker: str
    describe: Callable[[dict], str]
    """A row's hover text."""
    lower: bool = False
    """In the lower panel (MFU, the model states of CPU rows)."""
    hollow: bool = False
    scale: float = 1.0


@dataclass
class Figure:
    """One figure of the page: its heading, caption and drawing, or the sentence shown in its place."""

    id: str
    """fig1, fig2, ... in the order drawn: the page's anchor and the prefix of its markers' ids."""
    title: str
    caption: str
    svg: str = ""
    """The drawing, inline SVG; empty when skipped."""
    skipped: str = ""
    """The sentence shown instead, when the figure would have nothing to show."""
    kind: str = ""
    """What it draws ("memory-num_workers", "breakdown", "fit-maxima"): the page's data-kind."""
    only: str = ""
    """Skipped for want of a second x value: where every trial ran ("with 1 worker", "at micro-batch 64")."""
    png: bytes = b""
    """The drawing as PNG, for the kinds the figures were asked to keep (`Figures.png_kinds`)."""


class Figures:
    """What the figures share: their numbering, SVG (and PNG) output, panels, axes and markers (every
    marker tagged with an id and a hover title). The figures are subclasses: page.PageFigures gathers them.
    `png_kinds`: the kinds of figure also kept as PNG (Figure.png)."""

    def __init__(self, sweep: Sweep, png_kinds: Iterable[str] = ()):
        self.sweep = sweep
        self.png_kinds = set(png_kinds)
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
            if figure.kind in self.png_kinds:
                raster = io.BytesIO()
                fig.savefig(raster, format="png", dpi=PNG_DPI)
                figure.png = raster.getvalue()
        plt.close(fig)
        text = buffer.getvalue()
        text = text[text.index("<svg") :]  # drop the XML declaration and DOCTYPE: inline in HTML
        text = re.sub(
            r'<svg ([^>]*?)width="([\d.]+)pt" height="([\d.]+)pt"',
            lambda m: (
                f'<svg {m.group(1)}class="chart" role="img" aria-label="{html.escape(figure.title)}" '
                f'style="max-width:{float(m.group(2)) * 4 / 3:.0f}px"'
            ),
            text,
            count=1,
        )
        text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, count=1, flags=re.S)
        for gid, title in titles.items():  # the browser's hover text on each marker
            text = text.replace(f'<g id="{gid}">', f'<g id="{gid}"><title>{html.escape(title)}</title>', 1)
        return text

    def _facets(self, rows: pd.DataFrame, axis: str, second: bool = False):
        """One panel per value of the other axis (up to 3 a row; "1 worker", "micro-batch 64"), each with
        a second, lower panel when `second` (MFU, or the model states of CPU rows). Panels of one row
        share their y axis. Returns the figure and (top, bottom or None, value, rows, title) per panel."""
        other = "micro_batch_size" if axis == "num_workers" else "num_workers"
        values = sorted(rows[other].dropna().unique())
        columns = min(3, len(values))
        blocks = (len(values) + columns - 1) // columns
        per_block = 2 if second else 1
        fig, axes = plt.subplots(
            blocks * per_block,
            columns,
            squeeze=False,
            sharey="row",
            sharex="col" if second else "none",
            gridspec_kw={"height_ratios": [3, 2] * blocks} if second else None,
            figsize=(9.6 if columns > 1 else 7.6, (5.8 if second else 3.6) * blocks),
        )

        def title(value) -> str:
            if other == "micro_batch_size":
                return f"micro-batch {int_text(value)}"
            return f"{int_text(value)} worker" + ("" if int_text(value) == "1" else "s")

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
        ax.set_xticklabels([int_text(v) for v in values])
        if len(values) == 1:  # one x (a figure file drawn for one point per setting): room either side
            ax.set_xlim(values[0] - 0.5, values[0] + 0.5)
        ax.set_xlabel(
            "workers (data-parallel ranks)" if axis == "num_workers" else "micro-batch size per rank"
        )
        ax.grid(alpha=0.3)

    def _points(
        self, ax, group: pd.DataFrame, axis: str, line: Series, figure: Figure, titles: dict, colour: str
    ) -> int:
        """A line through a setting's points and one tagged marker per row (y = the column × its scale,
        hover text "TRIAL: " and its description); the number of markers drawn."""
        column, style, scale, hollow = line.column, line.style, line.scale, line.hollow
        drawn = group[group[column].notna()].sort_values(axis)
        if len(drawn) > 1:
            ax.plot(
                [self.shift(x) for x in drawn[axis]],
                drawn[column] * scale,
                style,
                color=colour,
                alpha=0.8 if style == "--" else 1.0,
            )
        for record in drawn.to_dict("records"):
            gid = f"{figure.id}--{line.role}--{record['trial']}"
            (marker_line,) = ax.plot(
                [self.shift(record[axis])],
                [record[column] * scale],
                line.marker,
                color=colour,
                markersize=8 if hollow else 6,
                markerfacecolor="none" if hollow else colour,
                linestyle="none",
                zorder=2.5 if hollow else 3,
            )
            marker_line.set_gid(gid)
            titles[gid] = f"{record['trial']}: {line.describe(record)}"
        return len(drawn)

    def cross(self, ax, x: float, y: float, gid: str, titles: dict, title: str, colour: str) -> None:
        """× at (x, y) for a trial that failed (out of memory: at the memory it held), tagged and titled."""
        (line,) = ax.plot(
            [self.shift(x)],
            [y],
            "X",
            color=colour,
            markersize=9,
            linestyle="none",
            markeredgecolor="black",
            markeredgewidth=0.6,
            zorder=3,
        )
        line.set_gid(gid)
        titles[gid] = title

    def colour(self, label: str) -> str:
        """An engine setting's colour, the same in every figure."""
        return colour_of(self.colours.get(label, 0))

    def legend(self, fig, used: Iterable[str], more: list) -> None:
        """Beside the axes: the colour of each engine setting drawn (in the table's order), then `more`."""
        used = set(used)
        settings = [
            Line2D([], [], color=self.colour(label), linewidth=6, label=label)
            for label in self.colours
            if label in used
        ]
        legend_right(fig, settings + more)

    def _by_setting(self, rows: pd.DataFrame):
        labels = rows.apply(setting_label, axis=1) if len(rows) else pd.Series(dtype=str)
        for label in self.colours:
            group = rows[labels == label]
            if len(group):
                yield label, group
