"""The sweep: check the grid against the cluster, start or join Ray (run/session.py), calibrate where
asked, run the trials with Ray Tune, one Ray Train run each (run/trial.py), and write the results as each
trial finishes (run/recorder.py). Points that need more workers than the cluster has, or that an engine
lacks, become `skipped` rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from ray import tune

from ray_zero.config import Experiment
from ray_zero.console import log
from ray_zero.measure import calibration
from ray_zero.models.describe import describe_model
from ray_zero.run.session import Session
from ray_zero.run.trial import trial_config
from ray_zero.store import load_trials


class SweepIncomplete(Exception):
    """The sweep stopped (Ctrl-C, SIGTERM) before every trial finished; its finished rows are saved."""

    def __init__(self, finished: int, total: int):
        super().__init__(f"{finished} of {total} trials finished")
        self.finished, self.total = finished, total


def calibrate(session: Session, total: Optional[int] = None) -> dict:
    """Short trials measure the model's activations per sample, per engine of the grid, at three sizes
    (ray_zero/calibration.py); their rows join the tables, and calibration.json predicts every later row."""
    points = calibration.calibration_points(
        session.experiment, session.model, session.plan.precision, session.plan.use_gpu
    )
    probe = calibration.probe_experiment(session.experiment)
    specs = [dataclasses.replace(session.spec(p, probe), label="calibration") for p in points]
    log.info(f"calibrating activations: {len(specs)} trials ({', '.join(s.name for s in specs)})")
    session.tuner(
        {"trial": tune.grid_search([trial_config(s) for s in specs])}, total, tune_name="tune-calibration"
    ).fit()
    names = {s.name for s in specs}
    rows = [row for row in load_trials(session.output_dir) if row["trial"] in names]
    found = calibration.write_calibration(
        session.output_dir, session.experiment, rows, session.plan.use_gpu, session.plan.precision
    )
    doubtful = any(fit["verdict"] != "ok" for fit in found["fits"])
    (log.warning if doubtful else log.info)(calibration.summary(found))
    return found


def run_sweep(
    experiment: Experiment,
    output_dir: Path,
    model=None,
    address: Optional[str] = None,
    command: Optional[str] = None,
    resume: bool = False,
    diagnostics: bool = False,
    verbose: bool = False,
):
    """Run the whole grid and return the results table (a pandas DataFrame)."""
    if model is None:
        model = describe_model(
            experiment.model,
            experiment.model_options,
            experiment.seq_len,
            experiment.input_shape,
            experiment.num_classes,
        )
    with Session(experiment, model, output_dir, address, command, resume, diagnostics, verbose) as session:
        plan = session.plan
        if not resume:
            session.record_skipped()
        early = f" (+{plan.started_early} starting early)" if plan.started_early else ""
        log.info(
            f"{len(plan.runnable)} trials ({len(plan.skipped)} skipped), up to "
            f"{plan.max_concurrent_trials} at once{early} on {'GPU' if plan.use_gpu else 'CPU'}, "
            f"{plan.precision}; results in {session.output_dir}"
        )
        total = len(plan.runnable) + len(plan.skipped)
        if calibration.wanted(session.experiment, plan.use_gpu):
            total += len(
                calibration.calibration_points(
                    session.experiment, session.model, plan.precision, plan.use_gpu
                )
            )
            if not resume:
                calibrate(session, total)
        specs = [session.spec(p) for p in plan.runnable]
        session.tuner({"trial": tune.grid_search([trial_config(spec) for spec in specs])}, total).fit()
        frame = session.finish()
        if len(frame) < total:  # Tune stops early on Ctrl-C or SIGTERM, after saving its state
            raise SweepIncomplete(len(frame), total)
        return frame
