"""The committed records (results/, bench/results/) load as `report` reads them, and are kept as data.

Each run folder is copied and its tables made again by this version (`report`'s tables without the page,
which bench/rerender_check.py draws for every folder): a folder that no longer loads fails here, not in a
user's `report`. Kept folders hold trials.jsonl.gz and no renders (bench/records.py).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from ray_zero.report.tables import rerender_tables

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from records import RECORDS, run_folders  # noqa: E402


def test_every_committed_run_folder_loads_and_gives_its_table_again(tmp_path):
    folders = run_folders()
    assert len(folders) > 100  # the records are found where they are kept
    problems = []
    for index, folder in enumerate(folders):
        copy = tmp_path / str(index)
        shutil.copytree(folder, copy)
        try:
            frame = rerender_tables(copy)
        except Exception as error:  # every folder's problem, not only the first
            problems.append(f"{folder.relative_to(ROOT)}: {type(error).__name__}: {error}")
            continue
        if (folder / "results.csv").is_file():
            kept = pd.read_csv(folder / "results.csv")
            if list(frame["trial"].astype(str)) != list(kept["trial"].astype(str)):
                problems.append(f"{folder.relative_to(ROOT)}: its trials are not results.csv's")
    assert not problems, "\n".join(problems)


def test_the_records_keep_data_not_renders():
    tracked = subprocess.run(
        ["git", "ls-files", "--", *RECORDS], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    renders = [name for name in tracked if name.endswith((".png", "report.html"))]
    plain = [name for name in tracked if name.endswith("/trials.jsonl")]
    assert tracked and not renders and not plain, (renders + plain)[:5]


def test_a_kept_folder_is_read_and_rewritten_compressed_and_is_no_sweeps_output(tmp_path):
    """`report --predict` rewrites trials.jsonl.gz where it read it; a sweep refuses a kept folder as its
    output (its rows would go to a trials.jsonl beside the kept one)."""
    from ray_zero.config import ConfigError
    from ray_zero.run.session import check_output_dir
    from ray_zero.store import KEPT_TRIALS_FILE, TRIALS_FILE, load_trials, replace_trials

    folder = tmp_path / "kept"
    shutil.copytree(ROOT / "results" / "zero1_mnist-h200", folder)
    rows = load_trials(folder)
    assert rows and not (folder / TRIALS_FILE).exists()
    rows[0]["error"] = "rewritten"
    replace_trials(folder, rows)
    assert not (folder / TRIALS_FILE).exists() and load_trials(folder)[0]["error"] == "rewritten"
    assert (folder / KEPT_TRIALS_FILE).read_bytes()[:2] == b"\x1f\x8b"  # gzip's magic
    with pytest.raises(ConfigError, match="gunzip"):
        check_output_dir(folder, resume=True)
