"""The sweep: check the grid against the cluster, start or join Ray, run the Tune grid, write results.

One Tune trial per runnable grid point (trial.run_trial); points that need more workers than the
cluster has become `skipped` rows. Results are rewritten after every finished trial.
"""
from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import ray
import yaml
from ray import tune
from ray.tune.result import AUTO_RESULT_KEYS

from ray_zero.config import ConfigError, Experiment
from ray_zero.plots import write_plots
from ray_zero.report import (EXPERIMENT_FILE, TRIALS_FILE, append_trial, atomic_write, join_storage, load_trials,
                             publish, read_provenance, write_results)
from ray_zero.rows import base_row, finish_row, trial_name
from ray_zero.trial import run_trial

DRIVER_MEMORY_BYTES = 256 * 1024 ** 2


class ClusterUnreachable(ConfigError):
    """--address (or RAY_ADDRESS) names no Ray cluster this process can join."""


class SweepIncomplete(Exception):
    """The sweep stopped (Ctrl-C, SIGTERM) before every trial finished; its finished rows are saved."""

    def __init__(self, finished: int, total: int):
        super().__init__(f"{finished} of {total} trials finished")
        self.finished, self.total = finished, total


@dataclass(frozen=True)
class Cluster:
    """What the sweep can use: GPUs and CPUs in total, where they come from."""

    gpus: int
    cpus: int
    source: str
    """'this machine' before a private Ray starts, or the address of the cluster."""

    def worker_capacity(self, experiment: Experiment, use_gpu: bool) -> int:
        return self.gpus if use_gpu else self.cpus // experiment.cpus_per_worker


@dataclass(frozen=True)
class Plan:
    """The grid split into what runs and what is skipped, with the settings every trial shares."""

    use_gpu: bool
    precision: str
    runnable: list[dict[str, int]]
    skipped: list[dict[str, int]]
    max_concurrent_trials: int
    capacity: int
    started_early: int = 0  # trials whose driver and controller start before GPUs or CPUs are free

    @property
    def trial_drivers(self) -> int:
        """Trials Tune runs at once: those training, plus any started early."""
        return self.max_concurrent_trials + self.started_early


def local_cluster() -> Cluster:
    import torch

    return Cluster(gpus=torch.cuda.device_count(), cpus=os.cpu_count() or 1, source="this machine")


def plan_sweep(experiment: Experiment, cluster: Cluster) -> Plan:
    """Decide device, precision, which points run and how many at once. Raises ConfigError."""
    if experiment.device == "gpu" and cluster.gpus == 0:
        raise ConfigError(f"device: gpu, but {cluster.source} has no GPU (use device: cpu or auto)")
    use_gpu = experiment.use_gpu(cluster.gpus > 0)
    precision = experiment.resolved_precision(use_gpu)
    if precision == "fp16" and not use_gpu:
        raise ConfigError(f"precision: fp16 needs a GPU and {cluster.source} has none (use fp32 or bf16 on CPU)")
    capacity = cluster.worker_capacity(experiment, use_gpu)
    points = experiment.grid.points()
    runnable = [p for p in points if p["num_workers"] <= capacity]
    skipped = [p for p in points if p["num_workers"] > capacity]
    unit = "GPUs" if use_gpu else f"CPUs at cpus_per_worker={experiment.cpus_per_worker}"
    if not runnable:
        raise ConfigError(
            f"grid.num_workers: no grid point can run: the smallest asks for "
            f"{min(p['num_workers'] for p in points)} workers, {cluster.source} has room for {capacity} "
            f"({cluster.gpus if use_gpu else cluster.cpus} {unit}); allowed: 1 to {capacity}")
    largest = max(p["num_workers"] for p in runnable)
    concurrent = max(1, capacity // largest)
    if experiment.max_concurrent_trials is not None:
        concurrent = min(concurrent, experiment.max_concurrent_trials)
    overlap = experiment.overlap_startup if experiment.overlap_startup is not None else use_gpu
    # One more trial may start only if it then has to wait: were it to fit beside the others, it
    # would train at once, past max_concurrent_trials.
    smallest = min(p["num_workers"] for p in runnable)
    early = int(overlap and len(runnable) > concurrent and (concurrent + 1) * smallest > capacity)
    return Plan(use_gpu, precision, runnable, skipped, concurrent, capacity, early)


def skipped_row(experiment: Experiment, point: dict[str, int], plan: Plan, cluster: Cluster) -> dict[str, Any]:
    row = base_row(experiment, point, plan.precision, plan.use_gpu)
    unit = "GPUs" if plan.use_gpu else "CPU workers"
    row.update(status="skipped",
               error=f"needs {point['num_workers']} workers; {cluster.source} has room for {plan.capacity} {unit}")
    return finish_row(row)


def check_output_dir(output_dir: Path, resume: bool = False) -> None:
    """Writable, and (unless resuming) without an earlier sweep's trials: a new sweep there would mix its
    rows into that sweep's table under its own provenance, and replace that sweep's report."""
    trials = output_dir / TRIALS_FILE
    if not resume and trials.is_file() and trials.stat().st_size:
        raise ConfigError(f"--output {output_dir}: already holds a sweep's results ({TRIALS_FILE}); give a new "
                          f"folder, or finish that sweep with --resume {output_dir}")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".ray_zero_write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"--output {output_dir}: folder is not writable ({error.strerror}); "
                          "give a folder you can write to") from None


def provenance(experiment: Experiment, cluster: Cluster, plan: Plan, command: str) -> dict[str, Any]:
    import deepspeed  # versions are part of every result
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = "none"
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return {
        "experiment": experiment.name,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "deepspeed": str(deepspeed.__version__),
        "ray": str(ray.__version__),
        "driver_gpus": gpu,
        "cpu": f"{cpu} ({os.cpu_count()} logical CPUs on the driver's machine)",
        "cluster": f"{cluster.source}: {cluster.gpus} GPUs, {cluster.cpus} CPUs",
        "device": "gpu" if plan.use_gpu else "cpu",
        "precision": plan.precision,
        "max_concurrent_trials": plan.max_concurrent_trials,
        "trials_started_early": plan.started_early,
    }


def _start_ray(address: Optional[str]):
    """Join the cluster at `address` (or RAY_ADDRESS, or the Ray this process already runs), else start
    a private Ray whose dashboard binds to 127.0.0.1. Returns (context, address joined or None)."""
    if ray.is_initialized():
        return ray.get_runtime_context(), "the running Ray instance"
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        context = ray.init(dashboard_host="127.0.0.1", log_to_driver=True, configure_logging=False)
        return context, None
    try:
        return ray.init(address=address, log_to_driver=True), address
    except (ConnectionError, RuntimeError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:300]
        raise ClusterUnreachable(f"--address {address}: cannot join the Ray cluster ({reason}); start one with "
                                 "`ray start --head`, or leave --address and RAY_ADDRESS unset for a private Ray") from None


def _start_autoscaling_coordinator() -> None:
    """Create Ray Data's autoscaling coordinator now, while Tune starts the first trial's driver.

    Ray Train's controller registers every run's resources with this detached actor, creating it on a
    Ray instance's first run and waiting for it: a new process and its imports, 3.2 s on the sweep's
    first trial on the H200 (bench/README.md, cut 6). It is the same call Ray Train makes (get or
    create, by name), so later controllers find it. A Ray without it is left as it is."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)
    except ImportError:
        return
    get_or_create_autoscaling_coordinator()  # returns at once; the actor starts in the background


def _remote_cluster(address: str) -> Cluster:
    total = ray.cluster_resources()
    return Cluster(gpus=int(total.get("GPU", 0)), cpus=int(total.get("CPU", 0)), source=f"the cluster at {address}")


class ResultsWriter(tune.Callback):
    """Runs in the sweep's process: record each finished trial and rewrite the tables.

    It keeps no rows of its own: Tune pickles it with the experiment, and a resumed sweep gets it
    back from that pickle, so everything lives in the output folder (trials.jsonl).
    """

    def __init__(self, output_dir: Path, storage: str):
        self.output_dir, self.storage = output_dir, storage
        self.started_at: dict[str, float] = {}

    def on_trial_start(self, iteration, trials, trial, **info):
        self.started_at[trial.trial_id] = time.time()

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._record(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._record(trial)

    def _record(self, trial) -> None:
        result = trial.last_result or {}
        # A trial whose driver itself died has no result: it still gets a row.
        row = _kept(result) if "status" in result else _crashed_row(trial)
        # Tune's view of the trial's life, for the start-up breakdown (bench/README.md).
        row.update(tune_started_at=self.started_at.get(trial.trial_id), tune_finished_at=time.time())
        append_trial(self.output_dir, row)
        write_results(self.output_dir, load_trials(self.output_dir), read_provenance(self.output_dir))
        publish(self.output_dir, self.storage)
        print(trial_summary(row), flush=True)


# A trial's Tune result is its row (every rank's report included) plus Tune's own bookkeeping.
_TUNE_KEYS = set(AUTO_RESULT_KEYS) | {"done", "trial_id", "experiment_tag", "should_checkpoint"}


def _kept(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k not in _TUNE_KEYS}


def trial_summary(row: dict[str, Any]) -> str:
    """One line per finished trial (Tune's own tables are switched off: verbose=0)."""
    def number(key: str, fmt: str) -> str:
        value = row.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    text = (f"ray_zero: {row['trial']}: {row['status']}; loss {number('loss_first', '.3f')} -> "
            f"{number('loss_last', '.3f')}, {number('samples_per_s', '.0f')} samples/s, peak "
            f"{number('peak_allocated_gib_max', '.3f')} GiB (predicted {number('predicted_peak_gib', '.3f')}), "
            f"{number('wall_s', '.1f')} s")
    return text + (f"; {row['error']}" if row.get("error") else "")


def _crashed_row(trial) -> dict[str, Any]:
    experiment = Experiment.model_validate(trial.config["experiment"])
    row = base_row(experiment, trial.config["point"], trial.config["precision"], trial.config["use_gpu"])
    error = getattr(trial, "error_msg", None) or "the trial's driver process stopped without a result"
    row.update(status="failed", error=str(error).strip().splitlines()[-1][:400])
    return finish_row(row)


def run_sweep(experiment: Experiment, output_dir: Path, address: Optional[str] = None,
              command: Optional[str] = None, resume: bool = False):
    """Run the whole grid and return the results table (a pandas DataFrame)."""

    command = command or " ".join(shlex.quote(a) for a in ["python", "-m", "ray_zero", *sys.argv[1:]])
    output_dir = output_dir.resolve()
    check_output_dir(output_dir, resume)
    experiment = experiment.with_absolute_data_dir()
    if not (address or os.environ.get("RAY_ADDRESS") or ray.is_initialized()):
        plan_sweep(experiment, local_cluster())  # reject impossible grids before Ray starts

    context, joined = _start_ray(address)
    try:
        _start_autoscaling_coordinator()
        cluster = _remote_cluster(joined) if joined else local_cluster()
        plan = plan_sweep(experiment, cluster)
        dashboard = getattr(context, "dashboard_url", None) or ray._private.worker.get_dashboard_url()
        print(f"ray_zero: Ray dashboard at http://{dashboard}" if dashboard else
              "ray_zero: no Ray dashboard (install ray[default] for it)", flush=True)
        prov = provenance(experiment, cluster, plan, command)
        if resume:  # the sweep's provenance is the original run's, plus when and how it was resumed
            prov = {**(read_provenance(output_dir) or {}), "resumed": prov["date"], "resume_command": command}
        atomic_write(output_dir / EXPERIMENT_FILE,
                     yaml.safe_dump({"experiment": experiment.model_dump(mode="json"), "provenance": prov},
                                    sort_keys=False))
        storage = experiment.storage_path or str(output_dir)
        if "://" not in storage:  # Tune, Train and pyarrow want an absolute folder
            storage = str(Path(storage).resolve())
        if not resume:
            for point in plan.skipped:
                append_trial(output_dir, skipped_row(experiment, point, plan, cluster))
            write_results(output_dir, load_trials(output_dir), prov)
        early = f" (+{plan.started_early} starting early)" if plan.started_early else ""
        print(f"ray_zero: {len(plan.runnable)} trials ({len(plan.skipped)} skipped), up to "
              f"{plan.max_concurrent_trials} at once{early} on {'GPU' if plan.use_gpu else 'CPU'}, "
              f"{plan.precision}; results in {output_dir}", flush=True)

        # The trial is a driver only (the work is in its Train workers): it reserves no CPU, so a
        # 2-CPU machine can still run a 2-worker trial. Tune needs some resource in the request:
        # a little memory, which the driver does use.
        trainable = tune.with_resources(run_trial, {"cpu": 0, "memory": DRIVER_MEMORY_BYTES})
        tune_dir = join_storage(storage, "tune")
        if resume:
            tuner = tune.Tuner.restore(tune_dir, trainable=trainable, resume_unfinished=True,
                                       resume_errored=False, restart_errored=True)
            # Trials that finished before the interruption keep their rows (trials.jsonl); only the rest run.
        else:
            tuner = tune.Tuner(
                trainable,
                param_space={
                    "experiment": experiment.model_dump(mode="json"),
                    "point": tune.grid_search(plan.runnable),
                    "precision": plan.precision,
                    "use_gpu": plan.use_gpu,
                    "storage_path": storage,
                },
                tune_config=tune.TuneConfig(
                    max_concurrent_trials=plan.trial_drivers,
                    # The next trial's driver runs in the finished one's process: no new process and
                    # imports for every trial (Tune's default for function trainables is False).
                    reuse_actors=True,
                    trial_name_creator=lambda t: trial_name(t.config["point"]),
                    trial_dirname_creator=lambda t: f"{trial_name(t.config['point'])}_{t.trial_id}",
                ),
                run_config=tune.RunConfig(name="tune", storage_path=storage,
                                          callbacks=[ResultsWriter(output_dir, storage)], verbose=0),
            )
        tuner.fit()  # every finished trial is already in trials.jsonl (the callback)
        frame = write_results(output_dir, load_trials(output_dir), prov)
        write_plots(frame, output_dir)
        publish(output_dir, storage)
        total = len(plan.runnable) + len(plan.skipped)
        if len(frame) < total:  # Tune stops early on Ctrl-C or SIGTERM, after saving its state
            raise SweepIncomplete(len(frame), total)
        return frame
    finally:
        if not joined:
            ray.shutdown()
