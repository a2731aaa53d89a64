"""Where a step's time went: a stacked bar per ok trial of its timed step's forward, backward, optimizer
step and exposed communication (means over the timed steps, mean over ranks: ray_zero/train/step_clock.py)."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ray_zero.report.figures import Figure, Figures, legend_right
from ray_zero.report.formatting import as_number

PHASES = [  # (column, label, colour), left to right
    ("forward_s", "forward", "#4c72b0"),
    ("backward_s", "backward", "#dd8452"),
    ("optimizer_s", "optimizer step", "#55a868"),
    ("exposed_comm_s", "communication waited for (exposed)", "#c44e52"),
]


class StepFigures(Figures):
    def step_split(self) -> Figure:
        figure = self.new(
            "Where a step's time went",
            "Each ok trial's timed step, split where the rank spent it: forward, backward, the optimizer "
            "step, and the time collectives held the rank outside them (exposed communication). Means over "
            "the timed steps and over ranks; hover a bar for its milliseconds.",
            "steps",
        )
        frame = self.sweep.frame
        ok = frame[frame["status"] == "ok"]["trial"] if len(frame) else []
        # trials.jsonl's rows: results.csv leaves the split out
        rows = [self.sweep.rows.get(str(t), {}) for t in ok]
        rows = [r for r in rows if as_number(r.get("step_s"))]
        if not rows:
            figure.skipped = "No ok trial has a step split (rows of an earlier version have none)."
            return figure
        fig, ax = plt.subplots(figsize=(9.6, 0.8 + 0.3 * len(rows)))
        positions = list(range(len(rows)))[::-1]
        lefts = [0.0] * len(rows)
        titles: dict[str, str] = {}
        for column, words, colour in PHASES:
            widths = [(as_number(r.get(column)) or 0.0) * 1e3 for r in rows]
            drawn = ax.barh(
                positions, widths, left=lefts, height=0.72, color=colour, linewidth=0.5, edgecolor="white"
            )
            for i, (row, width, rect) in enumerate(zip(rows, widths, drawn.patches)):
                gid = f"{figure.id}--{row['trial']}--{column}"
                rect.set_gid(gid)
                titles[gid] = (
                    f"{row['trial']}: {words} {width:.3g} ms of {as_number(row['step_s']) * 1e3:.3g}"
                )
                lefts[i] += width
        ax.set_yticks(positions)
        ax.set_yticklabels([r["trial"] for r in rows], fontsize=7.5)
        ax.set_xlabel("milliseconds per step")
        ax.grid(axis="x", alpha=0.3)
        handles = [Patch(color=colour, label=words) for _, words, colour in PHASES]
        legend_right(fig, handles, left_chars=max(len(r["trial"]) for r in rows))
        figure.svg = self.svg(fig, figure, titles)
        return figure
