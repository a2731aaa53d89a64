"""The column registry's type and its views: every figure a rank reports and every field of a trial's row
is one `Column` (its name, type, unit, tier, how ranks make it, one line of help), declared once in
ray_zero/schema/rank_columns.py or trial_columns.py. The tables (results.csv, per_rank.csv), results.md,
the console's table, report.html's table, the typed records (ray_zero/schema/records.py) and
docs/columns.md (`python -m ray_zero columns`) are all made from it: a column renamed there is renamed
everywhere, and a key the code writes that the registry lacks is refused when the record is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

TIERS = ("results", "per_rank", "record")
"""results: results.csv (one row per trial, what a user reads); per_rank: per_rank.csv (one row per rank);
record: trials.jsonl only (kept, re-read by `report`, shown nowhere else)."""
HOW = ("max", "min", "sum", "mean", "first", "slowest", "sum_all", "epochs", "fullest", "any")
"""How a trial column is made from its ranks' `of` column: max / min / sum / mean over the ranks that
report it; first: the first rank's; slowest: the largest time; sum_all: the sum when every rank reports
it (else blank); epochs: each epoch's mean; fullest: the model states of the rank holding the most;
any: true if any rank's is."""
HOW_TEXT = {
    "max": "max over ranks",
    "min": "min over ranks",
    "sum": "sum over ranks",
    "mean": "mean over ranks",
    "first": "the first rank's",
    "slowest": "the slowest rank's",
    "sum_all": "sum over ranks (blank unless every rank has it)",
    "epochs": "each epoch's mean over ranks",
    "fullest": "the rank holding the most model states",
    "any": "true if any rank's is",
}


@dataclass(frozen=True)
class Column:
    """One column: a field of a rank's report or of a trial's row."""

    name: str
    type: type
    """str, int, float, bool, list or dict (a cell holds None where it was not measured)."""
    unit: str
    """"GiB", "bytes", "s", "samples/s", ...; "" for names, flags and counts without one."""
    tier: str
    """results, per_rank or record (TIERS)."""
    help: str
    """One line: what it is (docs/columns.md, `python -m ray_zero columns`)."""
    how: str = ""
    """How the trial's value is made from its ranks' `of` (HOW); "" for the trial's own fields."""
    of: str = ""
    """The rank column a trial column aggregates."""
    heading: str = ""
    """The short heading of the console's and report.html's tables."""
    hint: str = ""
    """report.html's hover text (default: help)."""
    cpu_heading: str = ""
    """The heading where every row ran on CPU (a memory column is then the resident set, not the CUDA
    allocator's): console, report.html and results.md."""
    views: frozenset[str] = field(default_factory=frozenset)
    """Tables that show it beside its file: md (results.md), console, console_gpu, console_cpu (the
    final table, on GPU or CPU rows only), page (report.html's results table)."""
    place: int = 0
    """Its place in those tables, which read in one order (a peak beside its prediction and their ratio,
    then the model states beside theirs), not results.csv's."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"column {self.name}: tier {self.tier!r}, not one of {TIERS}")
        if self.how and (self.how not in HOW or not self.of):
            raise ValueError(f"column {self.name}: how {self.how!r} needs one of {HOW} and `of`")


def column(name: str, type_: type, unit: str, tier: str, help: str, **more: Any) -> Column:
    views = more.pop("views", ())
    return Column(name, type_, unit, tier, help, views=frozenset(views), **more)


class Registry:
    """An ordered set of columns, looked up by name and by view (order: the tables' order)."""

    def __init__(self, columns: Iterable[Column]):
        self.columns = tuple(columns)
        self.by_name = {c.name: c for c in self.columns}
        if len(self.by_name) != len(self.columns):
            seen: set[str] = set()
            twice = [c.name for c in self.columns if c.name in seen or seen.add(c.name)]
            raise ValueError(f"columns declared twice: {twice}")

    def names(self, *tiers: str) -> list[str]:
        return [c.name for c in self.columns if c.tier in tiers]

    def view(self, *names: str) -> list[Column]:
        """The columns any of these tables show, in their reading order."""
        return sorted((c for c in self.columns if c.views & set(names)), key=lambda c: c.place)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __getitem__(self, name: str) -> Column:
        return self.by_name[name]
