"""The report page's bar and fit figures: where each rank's memory went (measured against the memory
model's components) and, for a `fit` folder, its probes and the largest micro-batch that fits."""

from __future__ import annotations

from typing import Any, Optional

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ray_zero.measure.memory_model import GIB, predict_point
from ray_zero.report.data import SETTING_KEYS, _gib, _int_text, _number, _present, fmt, setting_label
from ray_zero.report.figures import Figure, Figures, _colour, _from_zero, legend_right

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
PREDICTED_REST = [
    ("bucket_bytes", "buckets"),
    ("step_transient_bytes", "step temporaries"),
    ("compute_bytes", "gathered/cast parameters"),
    ("workspace_bytes", "cuBLAS workspaces"),
    ("data_bytes", "data"),
]


class PageFigures(Figures):
    """Every figure of the page: those of `Figures`, the memory breakdown and the fit's two."""

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
            ranks.append(
                {
                    "label": "max over ranks",
                    "peak_allocated_gib": record.get("peak_allocated_gib_max"),
                    **aggregate,
                }
            )
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
            terms = [
                f"{words} {_gib(getattr(prediction, key) / GIB, 3)}"
                for key, words in PREDICTED_REST
                if getattr(prediction, key)
            ]
            step_wins = prediction.step_transient_bytes > activations + prediction.compute_bytes
            rest = (
                (
                    " ("
                    + ", ".join(terms)
                    + "; the step's temporaries "
                    + ("outlast" if step_wins else "come after")
                    + " the activations)"
                )
                if terms
                else ""
            )
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
                        ranks = [
                            dict(known[0][1], label=known[0][1]["label"] + " (lowest peak)"),
                            dict(known[-1][1], label=known[-1][1]["label"] + " (highest peak)"),
                        ]
                values = [p for p, _ in peaks if p is not None]
                if len(values) > 1:
                    spreads.append(
                        (
                            max(values) - min(values),
                            f"{record['trial']}: {min(values):.2f}–"
                            f"{max(values):.2f} GiB over {len(values)} ranks",
                        )
                    )
                for rank in ranks:
                    parts, _ = self._measured_bar(rank, cpu)
                    bars.append(
                        (
                            f"{record['trial']} · {rank['label']}",
                            parts,
                            record["trial"],
                            rank["label"].split(" (")[0].replace(" ", ""),
                            False,
                            "",
                        )
                    )
                predicted, rest = self._predicted_bar(record)
                if predicted is not None:
                    bars.append(
                        (
                            f"{record['trial']} · predicted",
                            predicted,
                            record["trial"],
                            "predicted",
                            True,
                            rest,
                        )
                    )
            fig, ax = plt.subplots(figsize=(9.6, 0.8 + 0.3 * len(bars)))
            titles: dict[str, str] = {}
            positions = list(range(len(bars)))[::-1]
            used = set()
            lefts = [0.0] * len(bars)
            largest = max((sum(v for v in bar[1].values() if v) for bar in bars), default=0.0)
            unit, unit_name = (GIB, "GiB") if largest >= GIB / 2 else (1024**2, "MiB")  # a seed model: MiB
            for key, words, colour in COMPONENTS:  # one barh per component and kind: fast for many rows
                for is_prediction in (False, True):
                    chosen = [
                        (i, y)
                        for i, (y, bar) in enumerate(zip(positions, bars))
                        if bar[4] is is_prediction and bar[1].get(key) is not None
                    ]
                    if not chosen:
                        continue
                    used.add(key)
                    widths = [bars[i][1][key] / unit for i, _ in chosen]
                    drawn = ax.barh(
                        [y for _, y in chosen],
                        widths,
                        left=[lefts[i] for i, _ in chosen],
                        height=0.72,
                        color=colour,
                        hatch="//" if is_prediction else None,
                        linewidth=0.5,
                        edgecolor="#444" if is_prediction else "white",
                    )
                    for (i, _), width, rect in zip(chosen, widths, drawn.patches):
                        name, _, trial, who, _, rest = bars[i]
                        gid = f"{figure.id}--{'predicted' if is_prediction else 'measured'}--{trial}--{who}--{key}"  # noqa: E501
                        rect.set_gid(gid)
                        titles[gid] = f"{name}: {words} {width:.3f} {unit_name}" + (
                            rest if key == "rest_bytes" else ""
                        )
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
            if (
                self.memory and not cpu
            ):  # the device's memory, where it is near enough to read beside the bars
                device = self.memory * GIB / unit
                if device < ax.get_xlim()[1] * 1.5:
                    ax.axvline(device, color="black", linestyle=":", linewidth=1)
            legend = [Patch(facecolor=c, label=w) for k, w, c in COMPONENTS if k in used]
            legend.append(
                Patch(facecolor="white", edgecolor="#444", hatch="//", label="predicted (memory model)")
            )
            legend_right(fig, legend, left_chars=max(len(b[0]) for b in bars))
            figure.svg = self.svg(fig, figure, titles)
            figure.caption = (
                "Per rank, the model states counted tensor by tensor after the first step (parameters, "
                "gradients, "
                "fp32 master weights, optimizer states) stacked to the measured peak; hatched, the memory "
                "model's "
                "components of its predicted peak (its 'rest': communication buckets, workspaces, this "
                "rank's data, "
                "the step's temporaries and gathered parameters)."
                if not cpu
                else "CPU rows: the model states counted tensor by tensor per rank against the memory model's; the peak "  # noqa: E501
                "resident set (Python, torch and Ray included) is not broken down."
            )
            if "unsplit_bytes" in used:
                figure.caption += (
                    " This folder's rows do not record the bytes saved for backward: the lilac part "
                    "is the peak less the model states (activations, buckets, temporaries together)."
                )
            if spreads:  # the widest three
                spreads.sort(key=lambda item: -item[0])
                figure.caption += (
                    " The peak over ranks, widest spread first: "
                    + "; ".join(text for _, text in spreads[:3])
                    + (f" (and {len(spreads) - 3} more trials)" if len(spreads) > 3 else "")
                    + "."
                )
            figures.append(figure)
        return figures

    # ---- fit

    def fit_probes(self) -> Figure:
        sweep = self.sweep
        frame = sweep.frame
        probes = frame[~frame["trial"].str.endswith("_timed")]
        budget = (
            _number(sweep.fit["budget_gib"].dropna().iloc[0])
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
                self._points(
                    ax,
                    done,
                    "micro_batch_size",
                    "peak_allocated_gib_max",
                    "probe",
                    figure,
                    titles,
                    colour,
                    "-",
                    "o",
                    lambda r: f"{r['trial']}: fits, peak {_gib(r['peak_allocated_gib_max'])}",
                )
                for record in setting[setting["status"] != "ok"].to_dict("records"):
                    y = _number(record["peak_allocated_gib_max"]) or budget
                    if y is None:
                        continue
                    gid = f"{figure.id}--oom--{record['trial']}"
                    (line,) = ax.plot(
                        [self.shift(record["micro_batch_size"])],
                        [y],
                        "X",
                        color=colour,
                        markersize=9,
                        markeredgecolor="black",
                        markeredgewidth=0.6,
                        linestyle="none",
                    )
                    line.set_gid(gid)
                    titles[gid] = (
                        f"{record['trial']}: {record['status']} ({str(record.get('error') or '')[:120]})"
                    )
                found = sweep.fit[
                    (sweep.fit["num_workers"] == workers) & sweep.fit["max_micro_batch"].notna()
                ]
                for answer in found.to_dict("records"):
                    if setting_label(answer) != label:
                        continue
                    match = done[done["micro_batch_size"] == answer["max_micro_batch"]]
                    y = _number(answer.get("peak_gib")) or (
                        _number(match["peak_allocated_gib_max"].iloc[0]) if len(match) else None
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
        _from_zero([f[0] for f in facets])
        facets[0][0].set_ylabel("peak per rank (GiB)")
        handles = [
            Line2D([], [], color=_colour(self.colours[label]), linewidth=6, label=label)
            for label in self.colours
            if label in used
        ]
        handles += [
            Line2D([], [], color="gray", marker="o", label="probe fits"),
            Line2D(
                [],
                [],
                color="gray",
                marker="X",
                linestyle="none",
                markeredgecolor="black",
                label="probe out of memory",
            ),
            Line2D(
                [], [], color="gray", marker="*", markersize=12, linestyle="none", label="largest that fits"
            ),
        ]
        if budget:
            handles.append(
                Line2D([], [], color="firebrick", linestyle="--", label=f"budget {budget:.2f} GiB")
            )
        legend_right(fig, handles)
        figure.svg = self.svg(fig, figure, titles)
        return figure

    def fit_maxima(self) -> Figure:
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
        found = fit[fit["max_micro_batch"].notna()]
        if len(found) < 2:
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
            colour = _colour(self.colours.get(label, 0))
            workers = _int_text(record["num_workers"])
            names.append((y, f"{label}, {workers} worker" + ("" if workers == "1" else "s")))
            key = f"{label.replace(' ', '_')}_w{_int_text(record['num_workers'])}"
            (bar,) = size.barh(y, record["max_micro_batch"], color=colour, height=0.7)
            bar.set_gid(f"{figure.id}--max--{key}")
            titles[f"{figure.id}--max--{key}"] = (
                f"{names[-1][1]}: micro-batch {_int_text(record['max_micro_batch'])}"
            )
            size.text(
                record["max_micro_batch"],
                y,
                f" {_int_text(record['max_micro_batch'])}",
                va="center",
                fontsize=7,
            )
            if _present(record.get("samples_per_s")):
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
