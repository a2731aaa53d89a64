"""`python -m ray_zero fit`: the largest micro-batch that fits, for every (engine, stage, workers) of the
grid (and seq_len, on a seq_len axis), and the fastest of them exported as the config to train with; or,
with `--target seq_len`, the longest sequence that fits at each micro-batch of the grid, by the same
search and the same confirmation (the first guess predicted from a step traced at each length tried).

One search (ray_zero/measure/search.py) per point, all its probes inside one Ray Train run (run/
search_trial.py drives it from a thread of this process; train/probing.py runs it on the ranks): the
ranks build the model once and train each probe's few steps in a fresh engine, a row of the same tables
as a sweep's trial. Searches run side by side where the cluster has room; where it has less room than
searches, those whose points share their workers (engine and worker count) share a run, one after
another, and pay its start once. The search's calibration (GPU, a model that is not a preset) comes
first and its answer's timed run last, in the same run. Writes fit.csv, fit.md (with the run each probe
ran in), best_ds_config.json (the DeepSpeed config the fastest DeepSpeed rank passed to
deepspeed.initialize), best_config.json, best_experiment.yaml + best_command.txt, fit.png
(run/fit_tables.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any, Optional

import ray

from ray_zero.config import Experiment, Point, is_calibration
from ray_zero.console import log
from ray_zero.measure import calibration, error_band
from ray_zero.measure.search import TARGETS, FitSettings, Steps, largest_predicted_to_fit
from ray_zero.report.frame import markdown_table
from ray_zero.rows import one_line_reason, trial_row
from ray_zero.run.fit_tables import key_of_row, keys_of, write_fit
from ray_zero.run.recorder import Recorder
from ray_zero.run.search_trial import SearchState, at_its_length, drive_searches
from ray_zero.run.session import Session
from ray_zero.run.sweep import SweepIncomplete
from ray_zero.store import load_trials
from ray_zero.train.grid_trace import trace_grid
from ray_zero.train.search_spec import SearchSpec, calibration_probes

PROBE_STEPS = 3
"""Steps of a probe (1 of warm-up): the peak comes with the first optimizer steps."""


def _searches(
    session: Session, budget: float, steps: Steps, rows: list[dict], target: str = "micro_batch"
) -> list[SearchSpec]:
    """One search per (engine, stage, workers, ...) point, with the probes a resumed fit already ran; a
    search that is done (its answer timed, or nothing left to probe) is left out."""
    probe_steps = min(PROBE_STEPS, session.experiment.steps or PROBE_STEPS)
    probe = session.experiment.probe(probe_steps)
    # The probes' own rates serve when the experiment is no longer than a probe; else each answer is timed.
    timed = session.experiment if (session.experiment.steps or 10**9) > probe_steps else None
    field = TARGETS[target]
    searches = []
    for key in keys_of(session, target):
        spec = session.spec(key.replace(**{field: steps.smallest}), probe)
        traced = spec.activations is not None and not isinstance(spec.activations, str)
        untraced = set() if traced else {(key.backend, key.activation_checkpointing)}
        # A length's calibration would serve that length only: a seq_len search predicts from traces alone.
        calibrate = target == "micro_batch" and bool(
            calibration.engines_to_calibrate(session.experiment, session.plan.use_gpu, untraced)
        )
        peaks = predicted_lengths(spec, budget, steps) if target == "seq_len" and spec.use_gpu else ()
        search = SearchSpec(spec, budget, steps, timed, calibrate, target=target, predicted_peaks=peaks)
        state = SearchState(search)
        for row in rows:
            if key_of_row(row, target) == key:
                state.add(row)
        if state.in_flight() is not None:
            searches.append(state.for_next_run())
    return searches


def predicted_lengths(spec, budget: float, steps: Steps) -> tuple[tuple[int, float], ...]:
    """fit --target seq_len on a GPU: the peak (GiB) predicted at each length the first guess needs
    (largest_predicted_to_fit's doubling and bisection, at the error band's upper end) and the length
    after it (the confirmation's), each from the point's step traced on the meta device at that length.
    Lengths not traced are left out."""
    peaks: dict[int, Optional[float]] = {}

    def predicted(length: int) -> Optional[float]:
        if length not in peaks:
            point = spec.point.replace(seq_len=length)
            source = spec.experiment.model_source(point)
            traced = next(iter(trace_grid(source, [point], spec.precision).values()))
            at = at_its_length(dataclasses.replace(spec, point=point, activations=traced))
            peaks[length] = trial_row(at).get("predicted_peak_gib")
        return peaks[length]

    band = error_band.band_for(error_band.class_of_info(spec.model))  # as SearchSpec.first_guess takes it
    guess = largest_predicted_to_fit(band.over(predicted), budget, steps)
    if guess is not None and steps.up(guess) <= steps.largest:
        predicted(steps.up(guess))
    return tuple((length, peak) for length, peak in sorted(peaks.items()) if peak is not None)


def run_fit(
    experiment: Experiment,
    output_dir: Path,
    model,
    settings: FitSettings,
    address: Optional[str] = None,
    resume: bool = False,
    diagnostics: bool = False,
    verbose: bool = False,
    command: Optional[str] = None,
    fits_checked: bool = False,
    profile=None,
):
    """Search, time, write the fit tables and the best configs; return the results table."""
    session = Session(
        experiment, model, output_dir, address, command, resume, diagnostics, verbose, fits_checked, profile
    )
    target = settings.target
    with session:
        budget = settings.budget(session.plan.use_gpu, session.cluster.gpu_memory_gib)
        steps = settings.steps(experiment.grid.micro_batch_size, getattr(model, "max_positions", None))
        rows = load_trials(session.output_dir) if resume else []
        searches = _searches(session, budget, steps, rows, target)
        what = "longest sequence" if target == "seq_len" else "largest micro-batch"
        log.info(
            f"fit: {len(searches)} searches for the {what} within {budget:.2f} GiB per rank on "
            f"{'GPU' if session.plan.use_gpu else 'CPU'}, {session.plan.precision}, each in one Ray Train "
            f"run; results in {session.output_dir}"
        )
        session.resume = False  # a resumed fit starts new searches from the probes its rows recorded
        if searches:
            recorder = Recorder(
                session.output_dir,
                session.storage,
                None,
                pages=False,
                on_row=CalibrationWriter(session, len(calibration_probes(searches[0]))),
                refresh_s=session.experiment.runtime.refresh_s,
            )
            session.recorders.append(recorder)
            run_searches(session, searches, recorder)
        frame = session.finish(pages=False)  # write_fit draws the pages, with the fit's section
        rows = load_trials(session.output_dir)
        fit_table = write_fit(session, rows, budget, steps, frame, target)
        if _searches(session, budget, steps, rows, target):
            raise SweepIncomplete(len(frame), len(frame) + 1)
        log.debug("fit:\n" + markdown_table(fit_table, list(fit_table.columns)))
        return frame


def in_runs(searches: list[SearchSpec], drivers: int) -> list[list[SearchSpec]]:
    """The searches grouped into runs: those whose points share their workers (engine, worker count) in one
    run, in order; a group split in halves while there are fewer runs than `drivers` (runs at once)."""
    groups: dict[tuple, list[SearchSpec]] = {}
    for search in searches:
        point = search.spec.point
        groups.setdefault((point.backend, point.num_workers), []).append(search)
    runs = list(groups.values())
    while len(runs) < drivers and any(len(run) > 1 for run in runs):
        largest = max(runs, key=len)
        at = runs.index(largest)
        runs[at : at + 1] = [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    return runs


def run_searches(session: Session, searches: list[SearchSpec], recorder: Recorder) -> None:
    """Drive the searches' runs (`in_runs`) from threads of this process (ray_zero/run/search_trial.py), as
    many at once as the plan runs trials (one more may start early); each row recorded as it comes. A
    driver that fails itself (a bug, Ray gone) leaves a failed row for each search it had not finished,
    and the others go on."""
    log = ray.get_actor(session.log_name)
    lock = threading.Lock()
    # Grouped by the runs that train at once: a run started early would only wait for the GPU.
    waiting, running = in_runs(searches, session.plan.max_concurrent_trials), [0]
    stamp = int(time.time())

    def record(row: dict[str, Any]) -> None:
        with lock:
            recorder.record(row, running=running[0])

    def driver() -> None:
        while True:
            with lock:
                if not waiting:
                    return
                group = waiting.pop(0)
                running[0] += 1
            name = group[0].name + (f"+{len(group) - 1}" if len(group) > 1 else "")
            states = [SearchState(search) for search in group]
            try:
                drive_searches(states, f"fit{stamp}-{name}", log, record)
            except Exception as error:  # noqa: BLE001  one run's driver: the others go on
                for state in states:
                    if not state.ended and state.in_flight() is not None:
                        record(
                            {
                                **trial_row(state.search.spec),
                                "status": "failed",
                                "error": f"the search's driver failed: {one_line_reason(error)}",
                            }
                        )
            finally:
                with lock:
                    running[0] -= 1

    threads = [
        threading.Thread(target=driver, name=f"ray_zero fit driver {i}", daemon=True)
        for i in range(min(len(waiting), session.plan.trial_drivers))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        while thread.is_alive():  # in steps: Ctrl-C reaches this thread, and the session ends the runs
            thread.join(0.5)


class CalibrationWriter:
    """calibration.json as soon as a search has measured its activations (each search calibrates at its
    own point; per engine, the first search to finish its calibration speaks for it), so that the rows
    recorded after it carry the calibrated prediction, as a sweep's do."""

    def __init__(self, session: Session, sizes: int):
        self.output_dir, self.experiment = session.output_dir, session.experiment
        self.use_gpu, self.precision, self.sizes = session.plan.use_gpu, session.plan.precision, sizes

    def __call__(self, row: dict[str, Any]) -> None:
        if not is_calibration(row["trial"]):
            return
        rows = load_trials(self.output_dir)
        chosen: list[dict] = []
        for backend in dict.fromkeys(r["backend"] for r in rows if is_calibration(r["trial"])):
            by_search: dict[Point, list[dict]] = {}
            for r in rows:
                if is_calibration(r["trial"]) and r["backend"] == backend:
                    by_search.setdefault(key_of_row(r), []).append(r)
            complete = [mine for mine in by_search.values() if len(mine) >= self.sizes]
            chosen += complete[0] if complete else []
        if chosen:
            found = calibration.write_calibration(
                self.output_dir, self.experiment, chosen, self.use_gpu, self.precision
            )
            doubtful = any(fit["verdict"] != "ok" for fit in found["fits"])
            (log.warning if doubtful else log.info)(calibration.summary(found))
