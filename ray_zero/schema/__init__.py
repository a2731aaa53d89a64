"""The column registry (every column of every table, declared once) and the typed records made from it;
the lowest layer: it imports nothing of ray_zero. ray_zero/schema/columns.py says how the rest uses it."""

from ray_zero.schema.columns import HOW_TEXT, Column, Registry
from ray_zero.schema.rank_columns import RANK
from ray_zero.schema.records import (
    RankReport,
    RecordError,
    TrialRecord,
    rank_report,
    recorded_record,
    trial_record,
)
from ray_zero.schema.trial_columns import TRIAL

__all__ = [
    "HOW_TEXT",
    "RANK",
    "TRIAL",
    "Column",
    "RankReport",
    "RecordError",
    "Registry",
    "TrialRecord",
    "rank_report",
    "recorded_record",
    "trial_record",
]
