"""The sweep: check the grid against the cluster, start or join Ray, run the trials with Ray Tune, write
results after every finished trial. `run_sweep` runs a grid; ray_zero/fit.py runs a search through the
same `Session`.

One Tune trial per runnable grid point (ray_zero/trial.py); points that need more workers than the
cluster has, or that an engine lacks, become `skipped` rows.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import importlib.metadata
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

import ray
import yaml
from ray import tune

from ray_zero.config import ConfigError, Experiment, Point, TrialSpec
from ray_zero.measure import calibration
from ray_zero.measure.calibration import read_calibration
from ray_zero.models.describe import describe_model
from ray_zero.report.tables import console_table, write_pages, write_results
from ray_zero.rows import finish_row, skipped_row, trial_row
from ray_zero.run.cluster import joined_cluster, start_ray
from ray_zero.run.plan import Cluster, Plan, check_model_fits, local_cluster, plan_sweep
from ray_zero.run.trial import run_trial, trial_config, trial_log
from ray_zero.store import (
    EXPERIMENT_FILE,
    TRIALS_FILE,
    append_trial,
    atomic_write,
    join_storage,
    load_trials,
    publish,
    read_provenance,
)

DRIVER_MEMORY_BYTES = 256 * 1024**2


class SweepIncomplete(Exception):
    """The sweep stopped (Ctrl-C, SIGTERM) before every trial finished; its finished rows are saved."""

    def __init__(self, finished: int, total: int):
        super().__init__(f"{finished} of {total} trials finished")
        self.finished, self.total = finished, total


def check_output_dir(output_dir: Path, resume: bool = False) -> None:
    """Writable, and (unless resuming) without an earlier sweep's trials: a new sweep there would mix its
    rows into that sweep's table under its own provenance."""
    trials = output_dir / TRIALS_FILE
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

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
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


def _number(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def trial_summary(row: dict[str, Any]) -> str:
    """One line per finished trial. On CPU the memory is what it is: the process's peak resident set, beside
    the model states counted tensor by tensor and what the memory model predicts for them."""
    text = (
        f"ray_zero: {row['trial']}: {row['status']}; loss {_number(row, 'loss_first', '.3f')} -> "
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


class Recorder:
    """Records finished trials in the output folder: trials.jsonl, the tables, (with `pages`) the plots
    and report.html, the copy on the storage path, a line and the progress on the console. It keeps no
    rows of its own (everything lives in trials.jsonl)."""

    pages = True
    """Plots and report.html after every row (a fit, whose probes come seconds apart while its ranks need
    the CPU, draws them once at its end)."""

    def __init__(self, output_dir: Path, storage: str, total: Optional[int], on_row=None, pages: bool = True):
        self.output_dir, self.storage, self.total, self.on_row, self.pages = (
            output_dir,
            storage,
            total,
            on_row,
            pages,
        )
        self.started = time.time()

    def record(self, row: dict[str, Any], running: int) -> None:
        row = finish_row(row, read_calibration(self.output_dir))
        row["recorded_at"] = time.time()  # when the sweep had it: what each trial adds to a sweep (bench/)
        append_trial(self.output_dir, row)
        frame = write_results(self.output_dir, load_trials(self.output_dir), read_provenance(self.output_dir))
        try:
            if self.pages:
                write_pages(self.output_dir, frame)
        except Exception as error:  # the tables are written; a figure must not end the sweep
            print(
                f"ray_zero: plots and report.html not written ({type(error).__name__}: {error}); "
                f"`python -m ray_zero report {self.output_dir}` draws them later",
                flush=True,
            )
        publish(self.output_dir, self.storage)
        if self.on_row is not None:
            self.on_row(row)
        of = f"/{self.total}" if self.total else ""
        print(trial_summary(row), flush=True)
        print(
            f"ray_zero: {len(frame)}{of} trials finished, {running} running, "
            f"{time.time() - self.started:.0f} s",
            flush=True,
        )


class ResultsWriter(Recorder, tune.Callback):
    """Runs in the sweep's process: records each finished trial. Tune pickles it with the sweep's state,
    so a resumed sweep gets it back."""

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._record(trial, trials)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._record(trial, trials)

    def _record(self, trial, trials) -> None:
        import json

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


class Session:
    """A sweep's Ray, cluster, plan and output folder, for a grid (`run_grid`) or a search
    (ray_zero/fit.py)."""

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
    ):
        self.command = command or " ".join(
            shlex.quote(a) for a in ["python", "-m", "ray_zero", *sys.argv[1:]]
        )
        self.output_dir = output_dir.resolve()
        check_output_dir(self.output_dir, resume)
        self.experiment, self.model, self.resume = experiment.with_absolute_paths(), model, resume
        self.diagnostics, self.address, self.verbose = diagnostics, address, verbose
        if not (address or os.environ.get("RAY_ADDRESS") or ray.is_initialized()):
            cluster = local_cluster()  # reject impossible grids before Ray starts
            check_model_fits(self.experiment, model.params, cluster, plan_sweep(self.experiment, cluster))

    def __enter__(self) -> "Session":
        context, self.joined = start_ray(self.address, self.verbose)
        try:
            self.cluster = joined_cluster(self.joined) if self.joined else local_cluster()
            self.plan = plan_sweep(self.experiment, self.cluster)
            check_model_fits(self.experiment, self.model.params, self.cluster, self.plan)
            dashboard = getattr(context, "dashboard_url", None)
            if dashboard:
                print(f"ray_zero: Ray dashboard at http://{dashboard}", flush=True)
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
            atomic_write(
                self.output_dir / EXPERIMENT_FILE,
                yaml.safe_dump(
                    {
                        "experiment": self.experiment.model_dump(mode="json"),
                        "model": dataclasses.asdict(self.model),
                        "provenance": prov,
                    },
                    sort_keys=False,
                ),
            )
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

    def __exit__(self, *exc) -> None:
        if not self.joined:
            ray.shutdown()

    def spec(self, point: Point, experiment: Optional[Experiment] = None) -> TrialSpec:
        return TrialSpec(
            experiment or self.experiment,
            point,
            self.plan.precision,
            self.plan.use_gpu,
            self.model,
            self.storage,
            self.diagnostics,
            private_ray=not self.joined,
        )

    def record_skipped(self) -> None:
        for point, reason in self.plan.skipped:
            append_trial(self.output_dir, skipped_row(self.spec(point), reason))
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
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Tune tables on the terminal
        # The trial is a driver only (the work is in its Train workers): it reserves no CPU, so a 2-CPU
        # machine can still run a 2-worker trial. Tune needs some resource in the request: a little memory.
        trainable = tune.with_resources(run_trial, {"cpu": 0, "memory": DRIVER_MEMORY_BYTES})
        param_space = {**param_space, "log_name": self.log_name} if search_alg is None else {}
        callbacks = [ResultsWriter(self.output_dir, self.storage, total, on_row)]
        tune_dir = join_storage(self.storage, tune_name)
        if self.resume:  # trials that finished keep their rows (trials.jsonl); only the rest run
            return tune.Tuner.restore(
                tune_dir,
                trainable=trainable,
                resume_unfinished=True,
                resume_errored=False,
                restart_errored=True,
                param_space=param_space,
            )
        return tune.Tuner(
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

    def finish(self, pages: bool = True):
        """The tables (and pages) once more, copied to the storage path; the table (a DataFrame)."""
        frame = write_results(self.output_dir, load_trials(self.output_dir), self.provenance)
        if pages:
            write_pages(self.output_dir, frame)
        publish(self.output_dir, self.storage)
        return frame


def calibrate(session: Session, total: Optional[int] = None) -> dict:
    """Short trials measure the model's activations per sample, per engine of the grid, at three sizes
    (ray_zero/calibration.py); their rows join the tables, and calibration.json predicts every later row."""
    points = calibration.calibration_points(session.experiment, session.model, session.plan.precision)
    probe = calibration.probe_experiment(session.experiment)
    specs = [dataclasses.replace(session.spec(p, probe), label="calibration") for p in points]
    print(
        f"ray_zero: calibrating activations: {len(specs)} trials ({', '.join(s.name for s in specs)})",
        flush=True,
    )
    session.tuner(
        {"trial": tune.grid_search([trial_config(s) for s in specs])}, total, tune_name="tune-calibration"
    ).fit()
    names = {s.name for s in specs}
    rows = [row for row in load_trials(session.output_dir) if row["trial"] in names]
    found = calibration.write_calibration(
        session.output_dir, session.experiment, rows, session.plan.use_gpu, session.plan.precision
    )
    print(f"ray_zero: {calibration.summary(found)}", flush=True)
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
        print(
            f"ray_zero: {len(plan.runnable)} trials ({len(plan.skipped)} skipped), up to "
            f"{plan.max_concurrent_trials} at once{early} on {'GPU' if plan.use_gpu else 'CPU'}, "
            f"{plan.precision}; results in {session.output_dir}",
            flush=True,
        )
        total = len(plan.runnable) + len(plan.skipped)
        if calibration.wanted(session.experiment, plan.use_gpu):
            total += len(calibration.calibration_points(session.experiment, session.model, plan.precision))
            if not resume:
                calibrate(session, total)
        specs = [session.spec(p) for p in plan.runnable]
        session.tuner({"trial": tune.grid_search([trial_config(spec) for spec in specs])}, total).fit()
        frame = session.finish()
        if len(frame) < total:  # Tune stops early on Ctrl-C or SIGTERM, after saving its state
            raise SweepIncomplete(len(frame), total)
        return frame


__all__ = ["run_sweep", "Session", "SweepIncomplete", "console_table", "trial_summary"]
