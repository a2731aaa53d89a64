"""A sweep's session: its Ray (joined or started), cluster, plan and output folder, the provenance it
records, and the Tuner that runs its trials (a grid) or fit's searches. ray_zero/run/sweep.py runs a grid
through it, ray_zero/run/fit.py a search."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import importlib.metadata
import os
import platform
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import ray
import yaml
from ray import tune

from ray_zero.config import ConfigError, Experiment, Point, TrialSpec
from ray_zero.console import log
from ray_zero.measure.calibration import read_calibration
from ray_zero.measure.gpu_profile import read_profile
from ray_zero.rows import finish_row, skipped_row
from ray_zero.run.cluster import NODE_ID_LABEL, head_node_id, joined_cluster, start_ray, stop_ray
from ray_zero.run.loggers import caller_state_kept, logger_callbacks
from ray_zero.run.plan import Cluster, Plan, check_model_fits, local_cluster, plan_sweep
from ray_zero.run.trial import run_trial
from ray_zero.run.trial_log import trial_log
from ray_zero.store import (
    EXPERIMENT_FILE,
    KEPT_TRIALS_FILE,
    TRIALS_FILE,
    append_trial,
    atomic_write,
    cpu_name,
    load_trials,
    publish,
    read_provenance,
    repair_trials,
    trials_path,
)

DRIVER_MEMORY_BYTES = 256 * 1024**2
TUNE_ENV = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_GLOBAL_CHECKPOINT_S": "600"}
"""Ray Tune's documented switches, read once as Tuner.fit starts: set for fit's span only. Its legacy
console output, silent at verbose=0 (the new engine still prints a table at a run's start and end). Its
experiment snapshot at most every 10 minutes (and at the end), unless the caller set their own period: a
sweep resumes from trials.jsonl, never from that snapshot, whose cost grows with the trials (Tune's "auto"
spends up to 5 % of the driver's time on it)."""
CALLERS_OWN = {"TUNE_GLOBAL_CHECKPOINT_S"}
"""Of TUNE_ENV, the switches a value in the caller's environment keeps."""


def tune_env(fit_env: dict[str, str]) -> dict[str, str]:
    """What Tuner.fit's span sets: TUNE_ENV (less the switches the caller set themselves) and `fit_env`."""
    env = {k: v for k, v in TUNE_ENV.items() if not (k in CALLERS_OWN and k in os.environ)}
    return {**env, **fit_env}


class _QuietTuner(tune.Tuner):
    """A Tuner whose fit() prints nothing of Tune's own, gives its loggers the environment they need
    (`fit_env`) for its span, and leaves this process's environment, and MLflow's URIs, as it found them."""

    fit_env: dict[str, str] = {}

    def fit(self):
        env = tune_env(self.fit_env)
        with caller_state_kept(*env):
            os.environ.update(env)
            return super().fit()


def check_output_dir(output_dir: Path, resume: bool = False) -> None:
    """Writable, and (unless resuming) without an earlier sweep's trials: a new sweep there would mix its
    rows into that sweep's table under its own provenance."""
    trials = trials_path(output_dir)
    if trials.name == KEPT_TRIALS_FILE:
        raise ConfigError(
            f"--output {output_dir}: a kept sweep's folder ({KEPT_TRIALS_FILE}); give a new folder, or "
            f"gunzip {trials} to resume it"
        )
    if not resume and trials.is_file() and trials.stat().st_size:
        raise ConfigError(
            f"--output {output_dir}: already holds a sweep's results ({TRIALS_FILE}); give a new "
            f"folder, or finish that sweep with --resume {output_dir}"
        )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".ray_zero_write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"--output {output_dir}: folder is not writable ({error.strerror}); "
            "give a folder you can write to"
        ) from None


def provenance(experiment: Experiment, cluster: Cluster, plan: Plan, command: str) -> dict[str, Any]:
    import torch

    cpu = cpu_name()
    gpu = (
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        if torch.cuda.is_available()
        else "none"
    )
    return {
        "experiment": experiment.name,
        "question": experiment.question,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "deepspeed": importlib.metadata.version("deepspeed"),
        "ray": str(ray.__version__),
        "driver_gpus": gpu,
        "gpu_memory_gib": cluster.gpu_memory_gib,
        "cpu": f"{cpu} ({os.cpu_count()} logical CPUs on the driver's machine)",
        "cluster": f"{cluster.source}: {cluster.gpus} GPUs, {cluster.cpus} CPUs",
        "device": "gpu" if plan.use_gpu else "cpu",
        "precision": plan.precision,
        "max_concurrent_trials": plan.max_concurrent_trials,
    }


def _import_report() -> None:
    """The tables' and figures' modules, in a thread of their own while Ray starts (Session.__enter__)."""
    try:
        import ray_zero.report.tables  # noqa: F401
    except ImportError:  # raised again where the tables are first written
        pass


class Session:
    """A sweep's Ray, cluster, plan and output folder, for a grid (`run_grid`) or a search
    (ray_zero/run/fit.py)."""

    def __init__(
        self,
        experiment: Experiment,
        model,
        output_dir: Path,
        address: Optional[str] = None,
        command: Optional[str] = None,
        resume: bool = False,
        diagnostics: bool = False,
        verbose: bool = False,
        fits_checked: bool = False,
        profile=None,
    ):
        self.command = command or " ".join(
            shlex.quote(a) for a in ["python", "-m", "ray_zero", *sys.argv[1:]]
        )
        self.output_dir = output_dir.resolve()
        check_output_dir(self.output_dir, resume)
        self.experiment, self.model, self.resume = experiment.with_absolute_paths(), model, resume
        self.diagnostics, self.address, self.verbose = diagnostics, address, verbose
        self.fits_checked = fits_checked
        self.profile = profile
        """runtime.profile as ray_zero.api read it before Ray (a gpu_profile.Profile): every trial's spec
        carries it, and its row the step predicted on it; read here where the caller did not."""
        if profile is None and self.experiment.runtime.profile:
            self.profile = read_profile(Path(self.experiment.runtime.profile))
        self.recorders: list = []
        """The recorders of this session's Tuners and searches (their drawing ends before finish's)."""

    def __enter__(self) -> "Session":
        if self.resume and repair_trials(self.output_dir):
            log.warning(f"{TRIALS_FILE}: a half-written last row was cut off; its trial runs again")
        # The tables' and figures' modules (matplotlib, Jinja2; no Ray) load while ray.init waits for
        # Ray's processes to start: half a second off the sweep's start.
        threading.Thread(target=_import_report, name="ray_zero import", daemon=True).start()
        context, self.joined = start_ray(self.address, self.verbose)
        try:
            self.cluster = joined_cluster(self.joined) if self.joined else local_cluster()
            self.plan = plan_sweep(self.experiment, self.cluster)
            if not (self.fits_checked and not self.joined):  # once: here, or before Ray (ray_zero.api)
                check_model_fits(self.experiment, self.model.params, self.cluster, self.plan)
            dashboard = getattr(context, "dashboard_url", None)
            if dashboard:
                log.info(f"Ray dashboard at http://{dashboard}")
            prov = {
                **provenance(self.experiment, self.cluster, self.plan, self.command),
                "diagnostics": self.diagnostics,
            }
            if self.resume:  # the sweep's provenance is the original run's, plus when and how it was resumed
                prov = {
                    **(read_provenance(self.output_dir) or {}),
                    "resumed": prov["date"],
                    "resume_command": self.command,
                }
            self.provenance = prov
            self.calibration = read_calibration(self.output_dir)
            # On CPU the step is traced only for its predicted time (no peak is predicted there).
            self.traces = self._trace() if self.plan.use_gpu or self.profile is not None else {}
            self._write_experiment()
            storage = self.experiment.runtime.storage_path or str(self.output_dir)
            self.storage = storage if "://" in storage else str(Path(storage).resolve())
            # One record of every trial's ranks for the whole sweep, named after its folder (so that a
            # resumed sweep finds it under the same name).
            self.log_name = "ray_zero_log_" + hashlib.sha1(str(self.output_dir).encode()).hexdigest()[:12]
            self._log = trial_log(self.log_name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _trace(self) -> dict:
        """Each (engine form, checkpointing) of the grid's step traced on the meta device, before any
        trial: what one micro-batch adds to a rank's memory (ray_zero/train/grid_trace.py)."""
        from ray_zero.train.grid_trace import describe_outcomes, trace_grid

        started = time.time()
        traces = trace_grid(self.experiment.model_source(), self.plan.runnable, self.plan.precision)
        log.info(describe_outcomes(traces, started))
        return traces

    def _write_experiment(self) -> None:
        atomic_write(
            self.output_dir / EXPERIMENT_FILE,
            yaml.safe_dump(
                {
                    "experiment": self.experiment.model_dump(mode="json"),
                    "model": dataclasses.asdict(self.model),
                    "provenance": self.provenance,
                },
                sort_keys=False,
            ),
        )

    def record_scheduling(self, text: str) -> None:
        """How the trials were scheduled (how many at once, sharing GPUs or not), in the provenance."""
        self.provenance = {**self.provenance, "scheduling": text}
        self._write_experiment()

    def __exit__(self, *exc) -> None:
        stop_ray(shutdown=not self.joined)

    def spec(self, point: Point, experiment: Optional[Experiment] = None) -> TrialSpec:
        from ray_zero.train.grid_trace import trace_key

        key = trace_key(point.backend, self.plan.precision, point.activation_checkpointing, point.seq_len)
        return TrialSpec(
            experiment or self.experiment,
            point,
            self.plan.precision,
            self.plan.use_gpu,
            self.model,
            self.storage,
            self.diagnostics,
            private_ray=not self.joined,
            activations=self.traces.get(key),
            calibration=self.calibration,
            profile=self.profile,
        )

    def record_skipped(self) -> None:
        """A row for each point the cluster or the engines cannot run (those a resumed sweep lacks)."""
        recorded = {row["trial"] for row in load_trials(self.output_dir)}
        for point, reason in self.plan.skipped:
            if self.spec(point).name not in recorded:
                append_trial(self.output_dir, skipped_row(self.spec(point), reason))
        from ray_zero.report.tables import write_results

        write_results(self.output_dir, load_trials(self.output_dir), self.provenance)

    def tuner(
        self,
        param_space: dict,
        total: Optional[int],
        search_alg=None,
        max_concurrent: Optional[int] = None,
        on_row=None,
        tune_name: str = "tune",
    ) -> tune.Tuner:
        """A Tuner of `run_trial` over param_space (a grid) or search_alg (a search)."""
        from ray_zero.run.recorder import ResultsWriter  # with the tables (see __enter__)

        # The trial is a driver only (the work is in its Train workers): it reserves no CPU, so a 2-CPU
        # machine can still run a 2-worker trial. Tune needs some resource in the request: a little memory.
        # On the head node (its id found through public API, placed by Ray's node-id label), as Ray Train's
        # placement-group cleaner: a driver on a worker node died with it, with the trial's Train
        # controller, and a worker group's placement group still pending then was never removed: it held
        # the node's CPUs once the node came back, and the sweep waited for them (bench/chaos.md).
        on_head = tune.PlacementGroupFactory(
            [{"memory": DRIVER_MEMORY_BYTES}], bundle_label_selector=[{NODE_ID_LABEL: head_node_id()}]
        )
        trainable = tune.with_resources(run_trial, on_head)
        param_space = {**param_space, "log_name": self.log_name} if search_alg is None else {}
        loggers, logger_env = logger_callbacks(
            list(self.experiment.runtime.loggers),
            self.experiment.name,
            self.output_dir,
            f"{self.storage}/{tune_name}",
        )
        writer = ResultsWriter(
            self.output_dir, self.storage, total, on_row, refresh_s=self.experiment.runtime.refresh_s
        )
        self.recorders.append(writer)
        callbacks = [writer, *loggers]
        tuner = _QuietTuner(
            trainable,
            param_space=param_space,
            tune_config=tune.TuneConfig(
                max_concurrent_trials=max_concurrent or self.plan.trial_drivers,
                search_alg=search_alg,
                num_samples=-1 if search_alg is not None else 1,  # a search runs until its searcher is done
                # The next trial's driver runs in the finished one's process: no new process and imports
                # for every trial (Tune's default for function trainables is False).
                reuse_actors=True,
                # Tune swaps non-primitive values (the spec) for placeholders until the trial runs: the
                # name travels beside it as a string.
                trial_name_creator=lambda t: t.config["trial"]["name"],
                trial_dirname_creator=lambda t: f"{t.config['trial']['name']}_{t.trial_id}",
            ),
            run_config=tune.RunConfig(
                name=tune_name, storage_path=self.storage, callbacks=callbacks, verbose=0
            ),
        )
        tuner.fit_env = logger_env
        return tuner

    def finish(self, pages: bool = True):
        """The tables (and pages) once more, each row as recorded with its prediction, copied to the
        storage path; the table (a DataFrame)."""
        from ray_zero.report.tables import write_pages, write_results

        for recorder in self.recorders:  # a drawing under way ends before the last one
            recorder.wait()
        rows = [finish_row(row) for row in load_trials(self.output_dir)]
        frame = write_results(self.output_dir, rows, self.provenance)
        if pages:
            write_pages(self.output_dir, frame)
        publish(self.output_dir, self.storage)
        return frame
