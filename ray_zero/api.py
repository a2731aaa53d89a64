"""ray_zero's Python API: what the command line does, for a script, a notebook, or a job submitted to a
Ray cluster (`ray job submit -- python examples/sweep_script.py`). The CLI is a thin layer over it.

    import ray_zero

    ray_zero.log_to_console()      # the CLI's `ray_zero: ...` lines on stdout
    results = ray_zero.sweep("experiments/quick.yaml", overrides=["grid.stage=[1]"], output="runs/quick")
    print(results.table[["trial", "status", "peak_allocated_gib_max", "predicted_peak_gib"]])
    found = ray_zero.fit("experiments/fit_gpt2_cpu.yaml", budget_gib=2.5)
    print(found.fit[["stage", "max_micro_batch", "samples_per_s"]], found.best_ds_config)
    print(ray_zero.estimate("hf:gpt2", workers=[1, 8], stages=[1, 3]))

An experiment is a YAML path, a mapping of its keys, or an `Experiment`; `overrides` are the CLI's `--set`
KEY=VALUE items. Bad input raises `ConfigError` (one line) before any Ray starts. Ray, torch and
DeepSpeed are imported when a function needs them, so `import ray_zero` and its input checks stay fast.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from ray_zero.config import ConfigError, Experiment
from ray_zero.experiment_file import load_experiment, validate_experiment
from ray_zero.measure.search import FitSettings
from ray_zero.run_folder import FitResults, Results
from ray_zero.store import EXPERIMENT_FILE, read_experiment_file, read_provenance

ExperimentLike = Union[str, os.PathLike, dict, Experiment]


def experiment_of(experiment: ExperimentLike, overrides: Sequence[str] = ()) -> Experiment:
    """An Experiment from a YAML path, a mapping of its keys or an Experiment, with `--set` overrides."""
    if isinstance(experiment, Experiment):
        raw = experiment.model_dump(mode="json", by_alias=True)
        return validate_experiment(raw, list(overrides), source=experiment.name) if overrides else experiment
    if isinstance(experiment, dict):
        return validate_experiment(experiment, list(overrides))
    if isinstance(experiment, (str, os.PathLike)):
        return load_experiment(experiment, list(overrides))
    raise ConfigError(
        f"experiment must be a YAML path, a mapping or an Experiment, not {type(experiment).__name__}"
    )


def describe(experiment: Experiment, address: Optional[str] = None, check_machine: bool = True):
    """The model's facts (models.describe.ModelInfo), before Ray starts; a bad model is one ConfigError
    line. On this machine's own Ray, a model whose states cannot fit is refused as soon as its parameters
    are counted (not for `estimate`, which plans for the cluster the user will have)."""
    from ray_zero.models.describe import describe_lengths
    from ray_zero.models.source import ModelError
    from ray_zero.run.plan import check_model_fits, local_cluster, plan_sweep

    def check(params: int) -> None:
        if check_machine and checks_here(address):
            cluster = local_cluster()
            check_model_fits(experiment, params, cluster, plan_sweep(experiment, cluster))

    try:
        # On a seq_len axis each value is checked against the model's positions, and counted apart.
        return describe_lengths(experiment.model_source(), experiment.grid.seq_len, check_params=check)
    except ModelError as error:
        raise ConfigError(f"model {experiment.model}: {error}") from None


def checks_here(address: Optional[str]) -> bool:
    """Whether the sweep will start a private Ray on this machine (no address, no RAY_ADDRESS, no Ray this
    process already runs): then the model's fit is checked against this machine once, before Ray, and
    the sweep's session does not check it again (run/session.py)."""
    ray = sys.modules.get("ray")
    running = ray is not None and hasattr(ray, "is_initialized") and ray.is_initialized()
    return not (address or os.environ.get("RAY_ADDRESS") or running)


def _use_cluster_token(address: Optional[str]) -> None:
    """`ray start --head` turns token authentication on where a token exists (~/.ray/auth_token); a client
    joining it at an address must say so in RAY_AUTH_MODE before Ray is imported (Ray reads it once, as it
    loads, and has no argument for it). Set only then, and left set: the process stays joined to that
    cluster after the sweep (ray_zero does not disconnect a cluster it joined), and child processes that
    join it need the same. A private Ray's own start sets it too; ray_zero/run/cluster.py's stop_ray puts
    that back."""
    joining = address or os.environ.get("RAY_ADDRESS")
    has_token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").is_file()
    if joining and has_token and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def _prepare(
    experiment, overrides, output, resume, address, profile=None
) -> tuple[Experiment, Path, Any, Any]:
    """The experiment (a resumed folder's own), the output folder, the model and the profile its rows'
    speed is predicted on (runtime.profile, which `profile` sets; None), all checked before Ray."""
    if profile is not None:  # --profile FILE: the experiment's runtime.profile (a JSON string is YAML)
        overrides = [*overrides, f"runtime.profile={json.dumps(str(profile))}"]
    if resume is not None:
        if experiment is not None or overrides:
            raise ConfigError(
                "--resume DIR takes no experiment file, --set or --profile: it reuses DIR's experiment"
            )
        output = Path(resume)
        saved = output / EXPERIMENT_FILE
        if not saved.is_file():
            raise ConfigError(f"--resume {output}: no {EXPERIMENT_FILE} there (give a sweep's output folder)")
        loaded = validate_experiment(read_experiment_file(output)["experiment"], source=str(saved))
    else:
        if experiment is None:
            raise ConfigError("give an experiment, e.g. experiments/quick.yaml")
        loaded = experiment_of(experiment, overrides)
        output = Path(output) if output else Path("runs") / f"{loaded.name}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    from ray_zero.run.stack import check_stack, environment_kept  # no Ray, torch or DeepSpeed

    check_stack(loaded)
    rates = _profile_of(loaded)
    with environment_kept():  # the caller's process as found (ray_zero/run/cluster.py: the rest)
        model = describe(loaded, address)
    _use_cluster_token(address)
    return loaded, output, model, rates


def _profile_of(experiment: Experiment):
    """runtime.profile read once, here (a measure.gpu_profile.Profile; None where not set): an unreadable
    file or another kind of file is one ConfigError line before Ray starts."""
    if not experiment.runtime.profile:
        return None
    from ray_zero.measure.gpu_profile import read_profile

    try:
        return read_profile(Path(experiment.runtime.profile).expanduser())
    except ConfigError as error:  # the reader's line, named as the setting (--profile sets it)
        raise ConfigError(str(error).replace("--profile ", "runtime.profile ", 1)) from None


def sweep(
    experiment: Optional[ExperimentLike] = None,
    *,
    overrides: Sequence[str] = (),
    output: Union[str, os.PathLike, None] = None,
    address: Optional[str] = None,
    resume: Union[str, os.PathLike, None] = None,
    diagnostics: bool = False,
    verbose: bool = False,
    command: Optional[str] = None,
    profile: Union[str, os.PathLike, None] = None,
) -> Results:
    """Run the experiment's grid, a Ray Train run per trial, and return its tables. `output`: the results
    folder (default runs/NAME-DATE); `address`: a Ray cluster to join ("auto" for the local `ray start`;
    default RAY_ADDRESS, else a private Ray); `resume`: finish an interrupted sweep in that folder.
    `profile`: a file of `profile` (sets runtime.profile): each row's step time predicted on it, beside
    the measured. Raises SweepIncomplete (its finished rows saved) when stopped early."""
    loaded, output, model, rates = _prepare(experiment, overrides, output, resume, address, profile)
    from ray_zero.run.sweep import run_sweep

    # A resumed sweep keeps what its first run collected: its unfinished trials run with the same diagnostics.
    diagnostics = diagnostics or bool(resume and (read_provenance(output) or {}).get("diagnostics"))
    run_sweep(
        loaded,
        output,
        model,
        address=address,
        resume=resume is not None,
        diagnostics=diagnostics,
        verbose=verbose,
        command=command,
        fits_checked=checks_here(address),
        profile=rates,
    )
    return Results.read(output)


def fit(
    experiment: Optional[ExperimentLike] = None,
    *,
    budget_gib: Optional[float] = None,
    margin_gib: float = 2.0,
    granularity: Optional[int] = None,
    max_micro_batch: int = 65536,
    target: str = "micro_batch",
    max_seq_len: Optional[int] = None,
    overrides: Sequence[str] = (),
    output: Union[str, os.PathLike, None] = None,
    address: Optional[str] = None,
    resume: Union[str, os.PathLike, None] = None,
    verbose: bool = False,
    command: Optional[str] = None,
    profile: Union[str, os.PathLike, None] = None,
) -> FitResults:
    """The largest micro-batch within `budget_gib` per rank (default on GPU: the device's memory less
    `margin_gib`; required on CPU) for every (engine, stage, workers) of the grid, each search in one Ray
    Train run, then the fastest exported as the config to train with (FitResults.best_ds_config).
    `target="seq_len"`: the longest sequence (to `max_seq_len`, default the model's positions) at each
    micro-batch of the grid instead, found and confirmed alike. `profile`: as sweep's."""
    settings = FitSettings(budget_gib, margin_gib, granularity, max_micro_batch, target, max_seq_len)
    loaded, output, model, rates = _prepare(experiment, overrides, output, resume, address, profile)
    settings.check(loaded.device)
    settings.check_model(model.seq_len, loaded.grid.seq_len)
    from ray_zero.run.fit import run_fit

    run_fit(
        loaded,
        output,
        model,
        settings,
        address=address,
        resume=resume is not None,
        verbose=verbose,
        command=command,
        fits_checked=checks_here(address),
        profile=rates,
    )
    return FitResults.read(output)


def estimate(
    model: Union[str, ExperimentLike] = "large",
    *,
    workers: Optional[Sequence[int]] = None,
    stages: Optional[Sequence[int]] = None,
    backend: Optional[Union[str, Sequence[str]]] = None,
    precision: Optional[str] = None,
    micro_batch_size: Optional[Union[int, Sequence[int]]] = None,
    seq_len: Optional[Union[int, Sequence[int]]] = None,
    calibration: Union[str, os.PathLike, None] = None,
    gpu_gib: Optional[float] = None,
    measured: Union[str, os.PathLike, None] = None,
    bandwidth: Union[str, os.PathLike, None] = None,
    busbw: Optional[float] = None,
    overrides: Sequence[str] = (),
    gpu: Optional[str] = None,
    profile: Union[str, os.PathLike, None] = None,
):
    """Every point of an experiment's grid predicted on a GPU, without training or Ray: `model` is an
    experiment (a YAML path, a mapping or an Experiment) or a model source (`hf:llama`, `timm:resnet50`,
    `large`, `pkg.module:factory`: the default experiment's grid for it). The keyword arguments narrow or
    override the grid (each is the `--set` of its key: workers is grid.num_workers, stages grid.stage,
    backend grid.backend, micro_batch_size grid.micro_batch_size, seq_len grid.seq_len, precision
    precision). Returns an Estimate: `.table` (GiB per rank, a row per point, as a sweep's row of it
    predicts), `.rows` and `.head`; print it for the CLI's text. `gpu_gib`: mark what would not fit
    (default: this machine's GPU, if it has one), allowing for the prediction's error band, the allocator's
    reserve and the CUDA context. `gpu`: the GPU's name (h100, A100-SXM4-80GB; default: this machine's),
    whose architecture the band is checked against. With `measured` (a sweep's folder; its experiment when
    `model` is empty) and `bandwidth` (a file of `bandwidth`) or `busbw` (GB/s): `.speed`, samples/s at
    each worker count. With `profile` (a file of `profile`): each point's step time, samples/s, MFU and what
    bounds it on that GPU, from its traced kernels and the engine's hooks, and with `bandwidth` or `busbw` its
    exposed communication."""
    from ray_zero.measure.gpu_profile import read_profile
    from ray_zero.report.estimate import estimate as estimate_table
    from ray_zero.report.estimate import grid_overrides, this_gpu, this_gpu_gib
    from ray_zero.report.speed_estimate import speed_head, speed_source, speed_table

    if gpu_gib is not None and not 0 < gpu_gib < math.inf:
        raise ConfigError(f"--gpu-gib {gpu_gib:g}: a GPU's memory in GiB, a number above 0")
    if gpu is not None and not gpu.strip():
        raise ConfigError("--gpu: give the GPU's name, e.g. h100, h200 or A100-SXM4-80GB")
    source = speed_source(measured, bandwidth, busbw, profile)
    rates = read_profile(Path(profile)) if profile is not None else None
    if not model and measured is not None:
        model = dict(read_experiment_file(Path(measured)).get("experiment") or {})
    narrowed = [*overrides, *grid_overrides(workers, stages, backend, precision, micro_batch_size, seq_len)]
    is_source = isinstance(model, str) and not model.endswith((".yaml", ".yml"))
    experiment = (
        validate_experiment({"steps": 2, "warmup_steps": 1}, [f"model={model}", *narrowed], source="estimate")
        if is_source
        else experiment_of(model, narrowed)
    )
    info = describe(experiment, check_machine=False)
    result = estimate_table(
        experiment,
        info,
        calibration_dir=calibration,
        gpu_gib=gpu_gib if gpu_gib else this_gpu_gib(),
        gpu=gpu or this_gpu(),
        profile=rates,
        bandwidth=source,
    )
    if measured is not None:
        from ray_zero.store import load_trials

        counts = workers or experiment.grid.num_workers
        result.speed = speed_table(
            load_trials(Path(measured)),
            info,
            counts,
            source,
            experiment.reduce_bucket_size,
            experiment.gradient_accumulation_steps,
        )
        result.speed_head = speed_head(source, measured)
        result.add_speed()
    return result


def profile(
    output: Union[str, os.PathLike] = "profile.json",
    *,
    device: Optional[str] = None,
    budget_s: float = 180.0,
    command: Optional[str] = None,
) -> Path:
    """What this machine's GPU (`device` "cuda"; "cpu" for the host; default: the GPU where there is one)
    reaches per kernel class, from micro-benchmarks within `budget_s` seconds (ray_zero/train/
    profile_bench.py), written to `output` for `estimate(profile=output)`. No Ray."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device: give cuda or cpu, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no GPU torch can use (give --device cpu)")
    if not 0 < budget_s < math.inf:
        raise ConfigError(f"--budget-s {budget_s:g}: give the seconds the profile may take, above 0")
    from ray_zero.train.profile_bench import write_profile

    return write_profile(Path(output), device, budget_s, command or "ray_zero.profile()")


def bandwidth(
    workers: Optional[int] = None,
    *,
    device: str = "auto",
    min_mib: int = 1,
    max_mib: int = 1024,
    iterations: int = 20,
    output: Union[str, os.PathLike] = "bandwidth.json",
    address: Optional[str] = None,
    command: Optional[str] = None,
) -> Optional[Path]:
    """Bus bandwidth of all-reduce, reduce-scatter and all-gather between `workers` of the cluster (default:
    its GPUs, else 2 CPU workers; one TorchTrainer run), messages of `min_mib` to `max_mib` MiB (powers of
    two), up to `iterations` timed calls each; written to `output` for `estimate(measured=...,
    bandwidth=output)`. None at one worker: nothing to measure, and Ray does not start."""
    from ray_zero.run.bandwidth import run_bandwidth

    _use_cluster_token(address)
    return run_bandwidth(
        workers,
        device,
        min_mib,
        max_mib,
        Path(output),
        command or "ray_zero.bandwidth()",
        address,
        iterations,
        private_ray=checks_here(address),
    )
