"""The sweep: check the grid against the cluster, start or join Ray (run/session.py), calibrate where
asked, run the trials with Ray Tune, one Ray Train run each (run/trial.py), and write the results as each
trial finishes (run/recorder.py). Points that need more workers than the cluster has, or that an engine
lacks, become `skipped` rows.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import ray
from ray import tune

from ray_zero.config import Experiment, TrialSpec
from ray_zero.console import log
from ray_zero.measure import calibration
from ray_zero.measure.calibration import read_calibration
from ray_zero.measure.prediction import GIB
from ray_zero.models.describe import describe_lengths
from ray_zero.rows import trial_row
from ray_zero.run.gpu_sharing import Sharing, gpu_shares, memory_need, trials_per_gpu
from ray_zero.run.session import Session
from ray_zero.run.trial import trial_config
from ray_zero.store import load_trials


class SweepIncomplete(Exception):
    """The sweep stopped (Ctrl-C, SIGTERM) before every trial finished; its finished rows are saved."""

    def __init__(self, finished: int, total: int):
        super().__init__(f"{finished} of {total} trials finished")
        self.finished, self.total = finished, total


class CalibrationRecorder:
    """calibration.json as soon as the calibration trials all have rows, so that the rows recorded after
    them carry the calibrated prediction (the sweep's tables are predicted again at its end). Plain data
    only: Tune pickles it with the sweep's state (no actor handle of this Ray may be inside)."""

    def __init__(self, session: Session, names: set[str]):
        self.names, self.output_dir, self.experiment = names, session.output_dir, session.experiment
        self.use_gpu, self.precision = session.plan.use_gpu, session.plan.precision

    def __call__(self, row: dict) -> None:
        if not self.names or row["trial"] not in self.names:
            return
        rows = [r for r in load_trials(self.output_dir) if r["trial"] in self.names]
        if len(rows) < len(self.names):
            return
        found = calibration.write_calibration(
            self.output_dir, self.experiment, rows, self.use_gpu, self.precision
        )
        doubtful = any(fit["verdict"] != "ok" for fit in found["fits"])
        (log.warning if doubtful else log.info)(calibration.summary(found))


def calibration_specs(session: Session) -> list[TrialSpec]:
    """Short trials that measure the model's activations per sample, per engine of the grid, at three
    sizes (ray_zero/measure/calibration.py), for the engines `calibrate` asks for: with `auto`, those
    whose step could not be traced. They run first and share GPUs like any other trial."""
    untraced = {
        (p.backend, p.activation_checkpointing)
        for p in session.plan.runnable
        if not _traced(session.spec(p).activations)
    }
    engines = calibration.engines_to_calibrate(session.experiment, session.plan.use_gpu, untraced)
    if not engines:
        return []
    points = calibration.calibration_points(
        session.experiment, session.model, session.plan.precision, session.plan.use_gpu, engines
    )
    probe = calibration.probe_experiment(session.experiment)
    return [dataclasses.replace(session.spec(p, probe), label="calibration") for p in points]


def _traced(activations) -> bool:
    return activations is not None and not isinstance(activations, str)


def _scheduling(session: Session, sharing: Optional[Sharing]) -> str:
    """The console's and provenance's words for how trials share the devices."""
    plan = session.plan
    if sharing is not None:
        return sharing.describe(session.cluster.gpus)
    early = f" (+{plan.started_early} starting early)" if plan.started_early else ""
    return f"up to {plan.max_concurrent_trials} at once{early} on {'GPU' if plan.use_gpu else 'CPU'}"


def shared(session: Session, specs: list[TrialSpec]) -> tuple[list[TrialSpec], Optional[Sharing]]:
    """The specs with their share of a GPU (ray_zero/run/gpu_sharing.py): on GPUs whose memory is known,
    unless runtime.share_gpus is off."""
    plan, runtime, gpu_gib = session.plan, session.experiment.runtime, session.cluster.gpu_memory_gib
    if not (plan.use_gpu and runtime.share_gpus and gpu_gib):
        return specs, None
    found = session.calibration
    saved = session.model.saved_bytes_per_sample
    sharing = gpu_shares(
        {s.name: memory_need(trial_row(s), found, saved) for s in specs},
        {s.name: s.point.num_workers for s in specs},
        gpu_gib * GIB,
        session.cluster.gpus,
        trials_per_gpu(
            runtime.max_trials_per_gpu,
            session.cluster.cpus,
            session.cluster.gpus,
            ray.cluster_resources().get("memory"),
        ),
    )
    return [
        dataclasses.replace(s, gpu_share=sharing.shares[s.name], gpu_room=sharing.room) for s in specs
    ], sharing


def run_sweep(experiment: Experiment, output_dir: Path, model=None, **session_options):
    """Run the whole grid and return the results table (a pandas DataFrame). `session_options`: Session's
    (address, command, resume, diagnostics, verbose, fits_checked: the model was checked against this
    machine before a private Ray, by ray_zero.api, and is not checked again)."""
    if model is None:
        model = describe_lengths(experiment.model_source(), experiment.grid.seq_len)
    session = Session(experiment, model, output_dir, **session_options)
    with session:
        plan = session.plan
        session.record_skipped()
        # A resumed sweep, whatever killed the first (Ctrl-C, SIGKILL, a lost head node), runs the points
        # without a row in trials.jsonl, in a Tuner of its own: the record of what finished is trials.jsonl,
        # not Tune's state (which a SIGKILL can leave behind it, or ahead of it).
        recorded = {row["trial"] for row in load_trials(session.output_dir)}
        calibrating = calibration_specs(session)
        grid = [session.spec(p) for p in plan.runnable]
        every = calibrating + grid
        to_run = [s for s in every if s.name not in recorded]
        pending = [s for s in calibrating if s.name not in recorded]
        # Calibration trials run first, in a Tuner of their own: every row of the grid is then predicted
        # once, when it is made, with the calibration it needs.
        phases = [pending, [s for s in grid if s.name not in recorded]] if pending else [to_run]
        sharing_text = None
        total = len(every) + len(plan.skipped)
        for number, phase in enumerate(phases):
            if number:  # the grid, after its calibration: its specs carry calibration.json
                session.calibration = read_calibration(session.output_dir)
                phase = [session.spec(s.point) for s in phase]
            specs, sharing = shared(session, phase)
            if sharing_text is None:
                sharing_text = _scheduling(session, sharing)
                if not session.resume:
                    session.record_scheduling(sharing_text)
                log.info(
                    f"{len(plan.runnable)} trials ({len(plan.skipped)} skipped"
                    f"{f', {len(pending)} calibrating activations first' if pending else ''})"
                    f"{f', {len(to_run)} to run' if session.resume else ''}, {sharing_text}, "
                    f"{plan.precision}; "
                    f"results in {session.output_dir}"
                )
            drivers = None
            if sharing is not None:  # one driver more than can hold GPUs: the next is ready when one ends
                drivers = min(sharing.at_once + 1, session.experiment.runtime.max_concurrent_trials or 10**6)
            if specs:
                name = "tune-calibration" if number == 0 and pending else "tune"
                session.tuner(
                    {"trial": tune.grid_search([trial_config(spec) for spec in specs])},
                    total,
                    max_concurrent=drivers,
                    on_row=CalibrationRecorder(session, {s.name for s in calibrating}),
                    tune_name=f"{name}-resumed-{int(time.time())}" if session.resume else name,
                ).fit()
        # The tables and the page are drawn while the session's exit shuts Ray down (which mostly waits
        # for Ray's processes to end): they need no Ray.
        pool = ThreadPoolExecutor(1, thread_name_prefix="ray_zero finish")
        finishing = pool.submit(session.finish)
    frame = finishing.result()
    pool.shutdown()
    if len(frame) < total:  # Tune stops early on Ctrl-C or SIGTERM, after saving its state
        raise SweepIncomplete(len(frame), total)
    return frame
