"""A `fit` folder's figures: its probes against micro-batch size with the budget and each setting's
largest micro-batch that fits, and those maxima with their timed samples/s."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from ray_zero.report.figures import Figure, Figures, Series, cross_handle, from_zero
from ray_zero.report.formatting import (
    SETTING_KEYS,
    as_number,
    fmt,
    gib_text,
    int_text,
    present,
    setting_label,
)

FITS = Series(
    "peak_allocated_gib_max",
    "probe",
    "-",
    "o",
    lambda r: f"fits, peak {gib_text(r['peak_allocated_gib_max'])}",
)
"""A probe that fitted: its measured peak."""


SEQ_LEN_TARGET = "A search of the longest sequence (fit --target seq_len): the fit table says what was found."


class FitFigures(Figures):
    """A fit's two figures (`fit_probes`, `fit_maxima`)."""

    def fit_probes(self) -> Figure:
        sweep = self.sweep
        frame = sweep.frame
        probes = frame[~frame["trial"].str.endswith("_timed")]
        budget = (
            as_number(sweep.fit["budget_gib"].dropna().iloc[0])
            if sweep.fit["budget_gib"].notna().any()
            else None
        )
        figure = self.new(
            "Fit: the probes",
            (
                "Every probe is a short trial at one micro-batch: its measured peak per rank (circles) or an "
                "out-of-memory failure (×, at the memory it held, else at the budget); the dashed line is "
                "the budget, "
                "the star each setting's largest micro-batch that fits. The timed reruns (trials ending in "
                "_timed) "
                "are in the table."
            ),
            "fit-probes",
        )
        if probes.empty or len(probes) < 2:
            figure.skipped = "Fewer than two probes: nothing to draw; the fit table says what was found."
            return figure
        if "max_micro_batch" not in sweep.fit:  # fit --target seq_len: drawn against micro-batches only
            figure.skipped = SEQ_LEN_TARGET
            return figure
        fig, facets = self._facets(probes, "micro_batch_size")
        titles: dict[str, str] = {}
        used = set()
        present = [label for label, _ in self._by_setting(probes)]
        for ax, _, workers, group, facet_title in facets:
            for label, setting in self._by_setting(group):
                used.add(label)
                self.dodge("micro_batch_size", probes["micro_batch_size"], present.index(label), len(present))
                colour = self.colour(label)
                done = setting[setting["status"] == "ok"]
                self._points(ax, done, "micro_batch_size", FITS, figure, titles, colour)
                for record in setting[setting["status"] != "ok"].to_dict("records"):
                    y = as_number(record["peak_allocated_gib_max"]) or budget
                    if y is not None:
                        gid = f"{figure.id}--oom--{record['trial']}"
                        why = str(record.get("error") or "")[:120]
                        title = f"{record['trial']}: {record['status']} ({why})"
                        self.cross(ax, record["micro_batch_size"], y, gid, titles, title, colour)
                found = sweep.fit[
                    (sweep.fit["num_workers"] == workers) & sweep.fit["max_micro_batch"].notna()
                ]
                for answer in found.to_dict("records"):
                    if setting_label(answer) != label:
                        continue
                    match = done[done["micro_batch_size"] == answer["max_micro_batch"]]
                    y = as_number(answer.get("peak_gib")) or (
                        as_number(match["peak_allocated_gib_max"].iloc[0]) if len(match) else None
                    )
                    if y is not None:
                        ax.plot(
                            [self.shift(answer["max_micro_batch"])],
                            [y],
                            "*",
                            color=colour,
                            markersize=22,
                            alpha=0.45,
                            markeredgecolor="black",
                            markeredgewidth=0.6,
                            linestyle="none",
                            zorder=1.5,
                        )
            if budget:
                ax.axhline(budget, color="firebrick", linestyle="--", linewidth=1)
            ax.set_title(facet_title, fontsize=9)
            self._x_axis(ax, "micro_batch_size", group["micro_batch_size"])
        from_zero([f[0] for f in facets])
        facets[0][0].set_ylabel("peak per rank (GiB)")
        handles = [
            Line2D([], [], color="gray", marker="o", label="probe fits"),
            cross_handle("probe out of memory"),
            Line2D(
                [], [], color="gray", marker="*", markersize=12, linestyle="none", label="largest that fits"
            ),
        ]
        if budget:
            handles.append(
                Line2D([], [], color="firebrick", linestyle="--", label=f"budget {budget:.2f} GiB")
            )
        self.legend(fig, used, handles)
        figure.svg = self.svg(fig, figure, titles)
        return figure

    def fit_maxima(self, even_one: bool = False) -> Figure:
        """The largest micro-batch per (setting, workers) and its samples/s; for a single one a sentence
        instead, unless `even_one` (fit.png, always written)."""
        fit = self.sweep.fit
        figure = self.new(
            "Fit: the largest micro-batch that fits",
            (
                "Per (setting, workers): the largest micro-batch whose measured peak stayed within the "
                "budget, and "
                "the samples/s of its timed run."
            ),
            "fit-maxima",
        )
        if "max_micro_batch" not in fit:
            figure.skipped = SEQ_LEN_TARGET
            return figure
        found = fit[fit["max_micro_batch"].notna()]
        if len(found) < (1 if even_one else 2):
            figure.skipped = (
                "One (setting, workers) point found a fitting micro-batch: the fit table says it all."
                if len(found)
                else "No point found a micro-batch that fits within the budget."
            )
            return figure
        fig, (size, speed) = plt.subplots(1, 2, figsize=(9.2, 0.9 + 0.32 * len(found)), sharey=True)
        names, titles = [], {}
        records = found.sort_values(SETTING_KEYS[:2] + ["num_workers"], kind="stable").to_dict("records")
        for y, record in zip(range(len(records))[::-1], records):
            label = setting_label(record)
            colour = self.colour(label)
            workers = int_text(record["num_workers"])
            names.append((y, f"{label}, {workers} worker" + ("" if workers == "1" else "s")))
            key = f"{label.replace(' ', '_')}_w{int_text(record['num_workers'])}"
            (bar,) = size.barh(y, record["max_micro_batch"], color=colour, height=0.7)
            bar.set_gid(f"{figure.id}--max--{key}")
            titles[f"{figure.id}--max--{key}"] = (
                f"{names[-1][1]}: micro-batch {int_text(record['max_micro_batch'])}"
            )
            size.text(
                record["max_micro_batch"],
                y,
                f" {int_text(record['max_micro_batch'])}",
                va="center",
                fontsize=7,
            )
            if present(record.get("samples_per_s")):
                speed.barh(y, record["samples_per_s"], color=colour, height=0.7)
                speed.text(
                    record["samples_per_s"], y, f" {fmt(record['samples_per_s'])}", va="center", fontsize=7
                )
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
