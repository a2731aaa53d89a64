"""Where each ray_zero trial's wall time went, from sweep folders that bench.py left (its `--throughput`
runs are one sweep each): one CSV row per trial, seconds per phase (bench.RAY_PHASES), slowest rank.

    python bench/trial_phases.py OUTPUT/throughput/*/ > phases.csv
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ray_rows  # noqa: E402


def phases(folders: list[Path]) -> pd.DataFrame:
    rows = []
    for folder in folders:
        for trial, row in ray_rows(folder).items():
            rows.append({"sweep": folder.name, "trial": trial, "tune_wall_s": row["tune_wall_s"],
                         **{k[len("ray "):]: v for k, v in row.items() if k.startswith("ray ")}})
    return pd.DataFrame(rows)


if __name__ == "__main__":
    phases([Path(p) for p in sys.argv[1:]]).round(3).to_csv(sys.stdout, index=False)
