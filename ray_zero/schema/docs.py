"""docs/columns.md, made from the column registry (`python -m ray_zero columns` prints it; a test keeps the
committed file equal to it)."""

from __future__ import annotations

from ray_zero.schema.columns import HOW_TEXT, Column, Registry
from ray_zero.schema.rank_columns import RANK
from ray_zero.schema.trial_columns import TRIAL

INTRO = """# The tables, column by column

Made from ray_zero's column registry (`ray_zero/schema/`; `python -m ray_zero columns` prints this page).
A sweep's folder holds three tiers of tables, rewritten atomically from trials.jsonl at most every
`runtime.refresh_s` seconds and at the sweep's end: `results.csv` (one row per trial), `per_rank.csv`
(one row per rank of each trial), and, only with `--diagnostics`, `diagnostics.csv`. `results.md` is the
results table in Markdown with its provenance (hardware, versions, date, command) and the columns a reader
compares; `report.html` shows more of them.
`trials.jsonl` is the record every table is rebuilt from (`python -m ray_zero report DIR`): each line one
trial's row, every rank's report inside it, checked against this registry when it is written. Units are
in the names too: `_gib` GiB (2^30 bytes), `_bytes`, `_s` seconds; `_at`, `_from`, `_until` are seconds
since the epoch."""

DIAGNOSTICS = """## diagnostics.csv (`--diagnostics`)

Each rank's wall-clock marks (`*_at`: when its training function began and each phase ended), the
trial's `fit_started_at` / `fit_finished_at`, the training thread's CPU time over the timed steps, its
time runnable without a core, its voluntary switches and CPU migrations, the other threads' CPU time,
Python's garbage collector, the process id and start, niceness, working directory and the folder of
DeepSpeed's JIT-built ops. bench/ reads them."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(columns: list[Column], made_from: bool) -> list[str]:
    heading = "| column | unit | meaning |" + (" from the ranks |" if made_from else "")
    lines = [heading, "|---|---|---|" + ("---|" if made_from else "")]
    for c in columns:
        cells = [f"`{c.name}`", c.unit, _cell(c.help)]
        if made_from:
            how = HOW_TEXT.get(c.how, "")
            cells.append(f"{how} of `{c.of}`" if c.how and c.how != "fullest" else how)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _tier(registry: Registry, tier: str) -> list[Column]:
    return [c for c in registry.columns if c.tier == tier]


def columns_markdown() -> str:
    """docs/columns.md as the registry says it now."""
    parts = [INTRO, "", "## results.csv", ""]
    parts += _table(_tier(TRIAL, "results"), made_from=True)
    parts += ["", "## per_rank.csv", "", "One row per rank of each trial.", ""]
    parts += _table(_tier(RANK, "per_rank"), made_from=False)
    parts += ["", "## trials.jsonl only", "", "A trial's row also keeps:", ""]
    parts += _table(_tier(TRIAL, "record"), made_from=True)
    parts += ["", "and each rank's report (`per_rank`):", ""]
    parts += _table(_tier(RANK, "record"), made_from=False)
    parts += ["", DIAGNOSTICS, ""]
    return "\n".join(parts)
