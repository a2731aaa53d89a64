"""Memory and throughput against workers and micro-batch size: the page's line figures, one panel per
value of the other axis, out-of-memory trials marked where they failed."""

from __future__ import annotations

from typing import Callable

import matplotlib.ticker
import pandas as pd
from matplotlib.lines import Line2D

from ray_zero.report.figures import Figure, Figures, Series, cross_handle, from_zero, hollow_handle
from ray_zero.report.formatting import as_number, fmt, gib_text, int_text, percent_text


class AgainstFigures(Figures):
    """The figures against workers or micro-batch size (`against`)."""

    def against(self, axis: str, what: str, kind: str, even_one: bool = False) -> Figure:
        """Memory (what="memory") or throughput (what="speed") of one memory kind against `axis`; with one
        value of `axis` a sentence instead, unless `even_one` (a figure file that is always written).

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
            caption = (
                "Peak CUDA memory allocated per rank, max over ranks: measured (solid, filled) against the "
                "memory model's prediction (dashed, hollow); × marks an out-of-memory trial at the memory "
                "it held when it failed."
                if gpu
                else "Above, each worker process's peak resident set (Python, torch and Ray included: not "
                "comparable with GPU memory). Below, on its own scale, the model states counted tensor by "
                "tensor (solid) and what the memory model predicts for them (dashed, hollow)."
            )
        else:
            title = f"Throughput against {axis_words} ({device})"
            caption = "Samples per second over the timed steps, summed over ranks" + (
                "; below, model FLOPs utilisation (MFU), mean over ranks." if gpu else "."
            )
        figure = self.new(title, caption, f"{what}-{axis}")
        plotted = pd.concat([ok, oom])
        if plotted.empty:
            figure.skipped = f"No {device} trial finished: nothing to draw against {axis_words}."
            return figure
        if plotted[axis].nunique() < 2 and not even_one:
            only = int_text(plotted[axis].iloc[0])
            figure.only = (
                (f"with {only} worker" + ("" if only == "1" else "s"))
                if axis == "num_workers"
                else f"at micro-batch {only}"
            )
            figure.skipped = (
                f"Every {device} trial ran {figure.only}: nothing to draw against {axis_words}; "
                "the table and the breakdown compare them."
            )
            return figure
        second = (not gpu and memory and ok["measured_model_state_gib"].notna().any()) or (
            gpu and not memory and ok["mfu"].notna().any()
        )
        fig, facets = self._facets(plotted, axis, second)
        series = _series(memory, gpu)
        titles: dict[str, str] = {}
        used: list[str] = []
        present = [label for label, _ in self._by_setting(plotted)]
        for top, bottom, _, group, facet_title in facets:
            for label, setting in self._by_setting(group):
                colour = self.colour(label)
                used.append(label)
                self.dodge(axis, plotted[axis], present.index(label), len(present))
                done = setting[setting["status"] == "ok"]
                for line in series:
                    ax = bottom if line.lower else top
                    if ax is not None:
                        self._points(ax, done, axis, line, figure, titles, colour)
                if memory:
                    self._failures(top, setting, axis, figure, titles, colour)
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
                    bottom.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        from_zero([f[0] for f in facets])
        from_zero([f[1] for f in facets])
        for top, bottom, *_ in facets:
            if top.get_subplotspec().colspan.start == 0:
                top.set_ylabel(
                    ("peak CUDA allocated per rank (GiB)" if gpu else "peak resident set per worker (GiB)")
                    if memory
                    else "samples/s, all ranks"
                )
                if bottom is not None:
                    bottom.set_ylabel("model states per rank (MiB)" if memory else "MFU")
        self.legend(fig, used, self._legend(memory, gpu, oom_shown=len(oom) > 0))
        figure.svg = self.svg(fig, figure, titles)
        if memory and gpu:
            figure.caption += (
                f" Dotted: the device's {self.memory:.1f} GiB (from {self.memory_source})."
                if self.memory
                else " The device's memory is not recorded in this folder: no line for it."
            )
        return figure

    def _failures(
        self, ax, setting: pd.DataFrame, axis: str, figure: Figure, titles: dict, colour: str
    ) -> None:
        """× for each out-of-memory trial, at the memory it held when it failed (else at the device's)."""
        for record in setting[setting["status"] == "oom"].to_dict("records"):
            y = as_number(record["peak_allocated_gib_max"]) or self.memory
            if y is not None:
                gid = f"{figure.id}--oom--{record['trial']}"
                title = f"{record['trial']}: out of memory at {gib_text(y)}"
                self.cross(ax, record[axis], y, gid, titles, title, colour)

    def _legend(self, memory: bool, gpu: bool, oom_shown: bool) -> list:
        """The legend's entries after the settings' colours: what each marker and line means."""
        handles: list = []
        if not memory:
            return handles
        if gpu:
            handles += [
                Line2D([], [], color="gray", marker="o", label="measured peak"),
                hollow_handle("s", "predicted peak"),
            ]
        else:
            handles += [
                Line2D([], [], color="gray", marker="o", label="peak resident set (RSS), measured"),
                Line2D([], [], color="gray", marker="^", label="model states, counted"),
                hollow_handle("^", "model states, predicted"),
            ]
        if oom_shown:
            handles.append(cross_handle("out of memory (memory at failure)"))
        if gpu and self.memory:
            handles.append(
                Line2D([], [], color="black", linestyle=":", label=f"device memory {self.memory:.1f} GiB")
            )
        return handles



def _series(memory: bool, gpu: bool) -> list[Series]:
    """GPU memory: the measured and predicted peak; CPU memory: the resident set, and below the model
    states counted and predicted, in MiB; throughput: samples/s, and below MFU."""
    if not memory:
        return [
            Series("samples_per_s", "measured", "-", "o", lambda r: f"{fmt(r['samples_per_s'])} samples/s"),
            Series("mfu", "mfu", "-", "D", lambda r: f"MFU {percent_text(float(r['mfu']))}", lower=True),
        ]
    peak = "peak" if gpu else "peak resident set"
    measured = Series(
        "peak_allocated_gib_max",
        "measured",
        "-",
        "o",
        lambda r: f"{peak} {gib_text(r['peak_allocated_gib_max'])} measured",
    )
    if gpu:
        predicted = lambda r: f"peak {gib_text(r['predicted_peak_gib'])} predicted"  # noqa: E731
        return [measured, Series("predicted_peak_gib", "predicted", "--", "s", predicted, hollow=True)]

    def states(column: str, how: str) -> Callable[[dict], str]:
        return lambda r: f"model states {float(r[column]) * 1024:.3f} MiB {how}"

    counted, predicted = "measured_model_state_gib", "predicted_model_state_gib"
    return [
        measured,
        Series(counted, "states", "-", "^", states(counted, "counted"), lower=True, scale=1024),
        Series(predicted, "predicted", "--", "^", states(predicted, "predicted"), True, True, 1024),
    ]
