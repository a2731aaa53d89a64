"""Where each rank's memory went: stacked bars of the model states counted tensor by tensor and the rest
of the measured peak, beside the memory model's components of its prediction."""

from __future__ import annotations

from typing import Any, Optional

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ray_zero.measure.prediction import GIB
from ray_zero.report.figures import Figure, Figures, legend_right
from ray_zero.report.formatting import SETTING_KEYS, as_number, gib_text, int_text

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
TERM_KEYS = (
    "parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes", "activation_bytes",
    "bucket_bytes", "step_transient_bytes", "compute_bytes", "workspace_bytes", "data_bytes",
)  # fmt: skip
"""The prediction's terms a row stores (predicted_*_gib, ray_zero/rows.py)."""
PREDICTED_REST = [
    ("bucket_bytes", "buckets"),
    ("step_transient_bytes", "step temporaries"),
    ("compute_bytes", "gathered/cast parameters"),
    ("workspace_bytes", "cuBLAS workspaces"),
    ("data_bytes", "data"),
]


class BreakdownFigures(Figures):
    """The memory breakdown (`breakdown`): one figure for a few trials, else one per engine setting."""

    def _measured_ranks(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Each rank's components (bytes) for one trial: per_rank.csv, else the row's max over ranks."""
        ranks = [
            {"label": f"rank {int_text(rank.get('rank'))}", **rank}
            for rank in self._ranks_by_trial().get(record["trial"], [])
        ]
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

    def _ranks_by_trial(self) -> dict[str, list[dict[str, Any]]]:
        """per_rank.csv's records by trial, in rank order: read once for all the bars."""
        if getattr(self, "_ranks", None) is None:
            self._ranks: dict[str, list[dict[str, Any]]] = {}
            per_rank = self.sweep.per_rank
            if per_rank is not None and len(per_rank):
                for rank in per_rank.sort_values("rank", kind="stable").to_dict("records"):
                    self._ranks.setdefault(rank["trial"], []).append(rank)
        return self._ranks

    def _measured_bar(self, rank: dict[str, Any], cpu: bool) -> tuple[dict[str, float], str]:
        parts = {key: (as_number(rank.get(key)) or 0.0) for key, _, _ in COMPONENTS[:4]}
        states = sum(parts.values())
        peak = as_number(rank.get("peak_allocated_gib"))
        if cpu or peak is None:
            return parts, ""
        peak *= GIB
        saved = as_number(rank.get("saved_for_backward_bytes"))
        if saved is not None:
            parts["activation_bytes"] = saved
            parts["rest_bytes"] = max(peak - states - saved, 0.0)
            return parts, ""
        parts["unsplit_bytes"] = max(peak - states, 0.0)
        return parts, "unsplit"

    def _predicted_bar(self, record: dict[str, Any]) -> tuple[Optional[dict[str, float]], str]:
        """The prediction's terms for a trial, as its row stores them, and what its 'rest' is made of
        (hover text)."""
        row = self.sweep.rows.get(record["trial"], record)
        term = {key: as_number(row.get(f"predicted_{key[: -len('_bytes')]}_gib")) for key in TERM_KEYS}
        if any(term[key] is None for key, _, _ in COMPONENTS[:4]):
            return None, ""
        term = {key: (value or 0.0) * GIB for key, value in term.items()}
        parts = {key: term[key] for key, _, _ in COMPONENTS[:4]}
        rest = ""
        peak = as_number(row.get("predicted_peak_gib"))
        if peak is not None:
            states = sum(parts.values())
            activations = term["activation_bytes"]
            parts["activation_bytes"] = activations
            parts["rest_bytes"] = max(peak * GIB - states - activations, 0.0)
            terms = [f"{words} {gib_text(term[key] / GIB, 3)}" for key, words in PREDICTED_REST if term[key]]
            step_wins = term["step_transient_bytes"] > activations + term["compute_bytes"]
            if terms:
                rest = (
                    f" ({', '.join(terms)}; the step's temporaries "
                    f"{'outlast' if step_wins else 'come after'} the activations)"
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
                peaks = [(as_number(r.get("peak_allocated_gib")), r) for r in ranks]
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
