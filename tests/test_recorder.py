"""The sweep's recorder (ray_zero/run/recorder.py) keeps a row's work flat: each row is appended as it
comes; the tables and pages are drawn at most every runtime.refresh_s seconds, and by the session at the
end. No Ray: the Recorder is what Tune's callback runs for each finished trial."""

from __future__ import annotations

import time

from ray_zero.run.recorder import Recorder
from ray_zero.store import load_trials


def _row(index: int) -> dict:
    return {"trial": f"stage1_mb{index}_w1", "status": "skipped", "model": "seed", "predicted_peak_gib": None}


def test_rows_are_appended_and_the_tables_wait_for_the_refresh(tmp_path):
    recorder = Recorder(tmp_path, str(tmp_path), total=100, pages=False, refresh_s=3600)
    for index in range(1, 6):
        recorder.record(_row(index), running=0)
    assert [r["trial"] for r in load_trials(tmp_path)] == [f"stage1_mb{i}_w1" for i in range(1, 6)]
    assert recorder.finished == 5
    assert not (tmp_path / "results.csv").exists()  # no table per row: the refresh has not come


def test_a_due_refresh_draws_the_tables_once_in_a_thread(tmp_path):
    recorder = Recorder(tmp_path, str(tmp_path), total=100, pages=False, refresh_s=0.2)
    recorder.record(_row(1), running=0)
    assert not (tmp_path / "results.csv").exists()
    time.sleep(0.3)
    recorder.record(_row(2), running=0)  # due: drawn beside the next rows, not in the caller
    recorder.wait()
    assert (tmp_path / "results.csv").read_text().count("stage1_mb") == 2
