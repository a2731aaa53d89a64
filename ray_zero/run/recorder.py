"""Each finished trial (or fit's probe) recorded as it comes: its row appended to trials.jsonl, its line
and the progress on the console; the tables, pages and the storage path's copy redrawn at most every
runtime.refresh_s seconds, never per row."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ray import tune

from ray_zero.console import log
from ray_zero.report.tables import write_pages, write_results
from ray_zero.rows import finish_row, trial_row
from ray_zero.store import append_trial, atomic_write, load_trials, publish, read_provenance


def write_stacks(output_dir: Path, trial: str, stacks: dict[str, str]) -> dict[str, str]:
    """Each rank's stacks to stacks/TRIAL/rankN.txt; those names, by rank."""
    folder = output_dir / "stacks" / trial
    folder.mkdir(parents=True, exist_ok=True)
    names = {}
    for rank, text in stacks.items():
        atomic_write(folder / f"rank{rank}.txt", text)
        names[rank] = f"stacks/{trial}/rank{rank}.txt"
    return names


def _number(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def trial_summary(row: dict[str, Any]) -> str:
    """One line per finished trial. On CPU the memory is what it is: the process's peak resident set, beside
    the model states counted tensor by tensor and what the memory model predicts for them."""
    text = (
        f"{row['trial']}: {row['status']}; loss {_number(row, 'loss_first', '.3f')} -> "
        f"{_number(row, 'loss_last', '.3f')}, {_number(row, 'samples_per_s', '.0f')} samples/s, "
    )
    if row.get("memory_kind") == "cpu_rss":
        text += (
            f"peak RSS {_number(row, 'peak_allocated_gib_max', '.2f')} GiB, model states "
            f"{_number(row, 'measured_model_state_gib', '.4f')} GiB (predicted "
            f"{_number(row, 'predicted_model_state_gib', '.4f')})"
        )
    else:
        text += (
            f"peak {_number(row, 'peak_allocated_gib_max', '.2f')} GiB (predicted "
            f"{_number(row, 'predicted_peak_gib', '.2f')})"
        )
    text += f", {_number(row, 'wall_s', '.1f')} s"
    return text + (f"; {row['error']}" if row.get("error") else "")


DRAW_SHARE = 0.02
"""Drawing takes at most this share of the sweep's time: the next drawing waits the last one's CPU time
over DRAW_SHARE when that is longer than refresh_s (bench/driver_bench.md)."""
DRAW_PER_ROW_S = 0.1
"""And at most this many CPU seconds per row: the next drawing also waits for as many rows as the last
one's CPU time over DRAW_PER_ROW_S, so that rows that come more slowly (a slower host) do not buy more
drawing per row (bench/driver_bench.md)."""
FIGURE_ROWS = 48
"""While a sweep runs, the page's figures are drawn from at most this many rows (spread over the table's
order), so a drawing costs the same at row 50 and row 500; the tables, and the last drawing, hold every
row."""


class Recorder:
    """Records finished trials in the output folder: each row appended to trials.jsonl as it comes, with a
    line and the progress on the console; the tables, (with `pages`) the plots and report.html, and the
    copy on the storage path drawn from trials.jsonl at most every `refresh_s` seconds, at most
    DRAW_SHARE of the time and DRAW_PER_ROW_S per row, in a thread of their own, and once more at the
    sweep's end (Session.finish). A row's own work stays the same however many rows came before it."""

    def __init__(
        self,
        output_dir: Path,
        storage: str,
        total: Optional[int],
        on_row=None,
        pages: bool = True,
        refresh_s: float = 30.0,
    ):
        self.output_dir, self.storage, self.total, self.on_row = output_dir, storage, total, on_row
        self.pages, self.refresh_s = pages, refresh_s
        self.started = self.drawn_at = time.time()
        self.draw_s = 0.0
        """The last drawing's CPU seconds (the next waits until they are DRAW_SHARE of the time)."""
        self.finished = len(load_trials(output_dir))  # a resumed sweep's rows, read once
        self.drawn_rows = self.finished  # rows recorded when the last drawing began
        self._drawing: Optional[threading.Thread] = None

    def __getstate__(self) -> dict:  # Tune pickles its callbacks with the sweep's state: no thread
        return {**self.__dict__, "_drawing": None}

    def record(self, row: dict[str, Any], running: int) -> None:
        row = finish_row(row)
        if row.get("stacks"):  # a timed-out trial's ranks' stacks: files beside the tables, named in the row
            row["stacks"] = write_stacks(self.output_dir, row["trial"], row["stacks"])
        row["recorded_at"] = time.time()  # when the sweep had it: what each trial adds to a sweep (bench/)
        append_trial(self.output_dir, row)
        self.finished += 1
        if self.on_row is not None:
            self.on_row(row)
        of = f"/{self.total}" if self.total else ""
        log.info(trial_summary(row))
        elapsed = time.time() - self.started
        log.info(f"{self.finished}{of} trials finished, {running} running, {elapsed:.0f} s")
        last = self.total is not None and self.finished >= self.total  # the session's finish draws it
        due = (
            time.time() - self.drawn_at >= max(self.refresh_s, self.draw_s / DRAW_SHARE)
            and (self.finished - self.drawn_rows) * DRAW_PER_ROW_S >= self.draw_s
        )
        if due and not last and (self._drawing is None or not self._drawing.is_alive()):
            self.drawn_at, self.drawn_rows = time.time(), self.finished
            self._drawing = threading.Thread(target=self.draw, name="ray_zero tables", daemon=True)
            self._drawing.start()

    def draw(self) -> None:
        """The tables (and pages) from trials.jsonl as it is, copied to the storage path."""
        started = time.thread_time()  # CPU time: what the drawing takes from the trials beside it
        try:
            self._draw()
        finally:
            self.draw_s = time.thread_time() - started
            self.drawn_at = time.time()

    def _draw(self) -> None:
        frame = write_results(self.output_dir, load_trials(self.output_dir), read_provenance(self.output_dir))
        try:
            if self.pages:
                write_pages(self.output_dir, frame, FIGURE_ROWS)
        except Exception as error:  # the tables are written; a figure must not end the sweep
            log.warning(
                f"plots and report.html not written ({type(error).__name__}: {error}); "
                f"`python -m ray_zero report {self.output_dir}` draws them later"
            )
        publish(self.output_dir, self.storage)

    def wait(self) -> None:
        """Until a drawing under way is done (the session's last drawing comes after it)."""
        if self._drawing is not None:
            self._drawing.join()


class ResultsWriter(Recorder, tune.Callback):
    """Runs in the sweep's process: records each finished trial. Tune pickles it with the sweep's state,
    so a resumed sweep gets it back."""

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._record(trial, trials)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._record(trial, trials)

    def _record(self, trial, trials) -> None:
        result = dict(trial.last_result or {})
        if "status" in result:
            row = {
                **{k: result[k] for k in result if k in _row_keys(result)},
                **json.loads(result.get("nested_json", "{}")),
            }
        else:  # a trial whose driver itself died has no result: it still gets a row
            row = _crashed_row(trial)
        self.record(row, running=sum(t.status == "RUNNING" for t in trials if t is not trial))


def _row_keys(result: dict) -> list[str]:
    """The row's own keys in a Tune result (Tune adds its bookkeeping: time_this_iter_s, trial_id, ...)."""
    from ray.tune.result import AUTO_RESULT_KEYS

    tune_keys = set(AUTO_RESULT_KEYS) | {
        "done",
        "trial_id",
        "experiment_tag",
        "should_checkpoint",
        "nested_json",
    }
    return [k for k in result if k not in tune_keys]


def _crashed_row(trial) -> dict[str, Any]:
    row = trial_row(trial.config["trial"]["spec"])
    error = getattr(trial, "error_msg", None) or "the trial's driver process stopped without a result"
    row.update(status="failed", error=str(error).strip().splitlines()[-1][:400])
    return row
