"""The GPU seen from outside while a benchmark runs: nvidia-smi sampling its clock and utilization every
250 ms into a CSV (`sample`), read back (`read`), and what it saw inside each point's timed windows
(`timed_window`): a clock that had not risen, or a GPU the host could not keep busy. For
bench/sweep_bench.py's --gpu-log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
from common import ROOT

sys.path.insert(0, str(ROOT))

from ray_zero.config import is_calibration  # noqa: E402
from ray_zero.store import load_trials  # noqa: E402

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu"
"""What nvidia-smi samples."""


def sample(path: Path) -> subprocess.Popen:
    """nvidia-smi appending QUERY to `path` every 250 ms until the returned process is terminated."""
    query = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader", "-lms", "250"]
    return subprocess.Popen(query, stdout=open(path, "a"), stderr=subprocess.STDOUT)


def read(output: Path) -> pd.DataFrame:
    """Every gpu_log*.csv in `output` (nvidia-smi, QUERY): time (epoch s), SM MHz, util %."""
    frames = []
    for path in sorted(output.glob("gpu_log*.csv*")):
        frame = pd.read_csv(path, header=None, names=QUERY.split(","), skipinitialspace=True)
        frame = frame[frame["timestamp"].astype(str).str.match(r"\d{4}/")]
        stamps = pd.to_datetime(frame["timestamp"], format="%Y/%m/%d %H:%M:%S.%f")  # the GPU machine's UTC
        frames.append(
            pd.DataFrame(
                {
                    "t": stamps.astype("datetime64[ns]").astype("int64") / 1e9,
                    "sm_mhz": frame["clocks.sm"].str.split().str[0].astype(float),
                    "util": frame["utilization.gpu"].str.split().str[0].astype(float),
                }
            )
        )
    return pd.concat(frames) if frames else pd.DataFrame(columns=["t", "sm_mhz", "util"])


def timed_window(runs: dict[str, list[Path]], log: pd.DataFrame) -> pd.DataFrame:
    """Per grid point and side: the lowest SM clock and the median utilization that nvidia-smi saw inside
    the point's timed windows (a clock that had not risen, or a GPU the host could not keep busy)."""
    seen: dict[tuple[str, str], list[pd.DataFrame]] = {}
    for side, folders in runs.items():
        for folder in folders:
            for row in load_trials(folder):
                for rank in row.get("per_rank") or []:
                    if rank.get("measuring_until") and rank.get("timed_s"):
                        until = rank["measuring_until"]
                        window = log[(log["t"] >= until - rank["timed_s"]) & (log["t"] <= until)]
                        seen.setdefault((row["trial"], side), []).append(window)
    table: dict[str, dict] = {}
    for (trial, side), windows in seen.items():
        samples = pd.concat(windows)
        if len(samples):
            entry = table.setdefault(trial, {"trial": trial})
            entry[f"sm_mhz_min_{side}"] = samples["sm_mhz"].min()
            entry[f"util_pct_{side}"] = samples["util"].median()
    return pd.DataFrame([table[t] for t in sorted(table) if not is_calibration(t)])
