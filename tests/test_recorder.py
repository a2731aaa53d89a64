"""The sweep's recorder (ray_zero/run/recorder.py) keeps a row's work flat: each row is appended as it
comes; the tables and pages are drawn at most every runtime.refresh_s seconds, and by the session at the
end. No Ray: the Recorder is what Tune's callback runs for each finished trial."""

from __future__ import annotations

import time

from ray_zero.run import recorder as recorder_module
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


class SlowDrawing(Recorder):
    """Drawing that takes at least 0.1 s of CPU, as the pages of a few hundred rows take seconds."""

    def _draw(self) -> None:
        until = time.thread_time() + 0.1
        while time.thread_time() < until:
            pass
        super()._draw()


def test_drawing_takes_at_most_its_share_of_the_sweeps_time(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder_module, "DRAW_SHARE", 0.1)  # the rule, at a share the test can wait out
    recorder = SlowDrawing(tmp_path, str(tmp_path), total=100, pages=False, refresh_s=0.01)
    recorder.record(_row(1), running=0)
    time.sleep(0.02)
    recorder.record(_row(2), running=0)  # due: refresh_s has passed and nothing was drawn yet
    recorder.wait()
    assert recorder.draw_s >= 0.1
    time.sleep(0.05)
    recorder.record(_row(3), running=0)  # refresh_s has passed, the last drawing over the share has not
    recorder.wait()
    assert (tmp_path / "results.csv").read_text().count("stage1_mb") == 2
    time.sleep(recorder.draw_s / recorder_module.DRAW_SHARE)
    recorder.record(_row(4), running=0)
    recorder.wait()
    assert (tmp_path / "results.csv").read_text().count("stage1_mb") == 4


def test_drawing_takes_at_most_its_cpu_seconds_per_row(tmp_path, monkeypatch):
    monkeypatch.setattr(recorder_module, "DRAW_SHARE", 1000.0)  # the share out of the way: rows only
    monkeypatch.setattr(recorder_module, "DRAW_PER_ROW_S", 0.05)
    recorder = SlowDrawing(tmp_path, str(tmp_path), total=100, pages=False, refresh_s=0.0)
    recorder.record(_row(1), running=0)  # nothing drawn yet: due
    recorder.wait()
    rows_needed = recorder.draw_s / recorder_module.DRAW_PER_ROW_S  # at least 2 (0.1 s or more of CPU)
    index = 1
    while index - 1 < rows_needed - 1:
        index += 1
        recorder.record(_row(index), running=0)  # too few rows since the last drawing for its cost
        recorder.wait()
        assert (tmp_path / "results.csv").read_text().count("stage1_mb") == 1
    recorder.record(_row(index + 1), running=0)
    recorder.wait()
    assert (tmp_path / "results.csv").read_text().count("stage1_mb") == index + 1
