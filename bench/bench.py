"""ray_zero against bare DeepSpeed, same configurations, one invocation, one machine.

    python bench/bench.py --packing --output bench/results/cpu-2core     # quick.yaml's grid
    python bench/bench.py experiments/memory_scaling.yaml --set 'grid.num_workers=[1,2]' --output /tmp/large
    python bench/bench.py ... --throughput 3 --output /tmp/throughput      # samples/s only, repeated
    python bench/bench.py ... --set 'grid.num_workers=[1]' --throughput 5 --side-by-side --output /tmp/sbs

For every runnable grid point it runs bare DeepSpeed under torchrun (bench/bare_deepspeed.py:
ray_zero.worker.train, no Ray), then, per worker count, the same points as a ray_zero sweep on a Ray
with room for one trial (Ray Tune + Ray Train, trials one at a time). It writes bench.md / bench.csv
with the steady-state samples/s ratio (ray_zero / bare), the per-trial overhead (wall time minus timed
steps) and where each trial's start-up went. `--packing` adds a grid of eight 1-worker trials and
compares the sweep's wall time with the sum of its trials' wall times; `--throughput R` measures
samples/s only, bare and ray_zero alternating R times; with `--side-by-side`, at the same time on a
GPU each, so that a shared host's drift hits both alike.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_zero.config import load_experiment  # noqa: E402
from ray_zero.report import atomic_write, load_trials, markdown_table, read_provenance  # noqa: E402
from ray_zero.sweep import local_cluster, plan_sweep, run_sweep  # noqa: E402
from ray_zero.rows import aggregate_ranks, trial_name  # noqa: E402

# Phases of a trial's life, from time marks (wall clock, seconds since the epoch) taken by the
# sweep (Tune callback), the trial driver, every rank, and for bare runs the launching process.
# Each rank's own phases from the start of its training function, the same under both launchers.
RANK_PHASES = [
    ("model build", "train_started_at", "model_built_at"),
    ("data load", "model_built_at", "data_loaded_at"),
    ("deepspeed.initialize", "data_loaded_at", "initialized_at"),
    ("first step: forward (host)", "initialized_at", "first_forward_at"),
    ("first step: backward, device caught up", "first_forward_at", "first_backward_at"),
    ("first step: optimizer step", "first_backward_at", "first_step_at"),
    ("other warm-up steps", "first_step_at", "warmed_up_at"),
    ("timed steps", "warmed_up_at", "finished_at"),
]
RAY_PHASES = [
    ("tune: start the trial driver process (once per sweep)", "driver_spawned_at", "tune_started_at"),
    ("tune: schedule trial, start driver", "tune_started_at", "driver_started_at"),
    ("driver: queue actor, TorchTrainer", "driver_started_at", "fit_started_at"),
    ("train: controller, placement group, worker processes", "fit_started_at", "process_started_at"),
    ("started early: previous trial's result to this trial's worker processes", "previous_result_at",
     "process_started_at"),
    ("worker: Python, Ray actor, train context, torch, process group", "process_started_at",
     "train_fn_started_at"),
    ("worker: import deepspeed", "train_fn_started_at", "train_started_at"),
    *RANK_PHASES,
    ("train: report, shut workers down", "finished_at", "fit_finished_at"),
    ("tune: result to the sweep", "fit_finished_at", "tune_finished_at"),
]
BARE_PHASES = [
    ("torchrun: launch processes", "launched_at", "process_started_at"),
    ("worker: Python, import torch", "process_started_at", "imported_at"),
    ("worker: process group", "imported_at", "process_group_at"),
    ("worker: import deepspeed", "process_group_at", "train_started_at"),
    *RANK_PHASES,
    ("gather results, exit", "finished_at", "exited_at"),
]
RANK_MARKS = ("process_started_at", "imported_at", "process_group_at", "train_fn_started_at", "train_started_at",
              "model_built_at", "data_loaded_at", "initialized_at", "first_forward_at", "first_backward_at",
              "first_step_at", "warmed_up_at", "finished_at")


def _slowest_rank_marks(per_rank: list[dict]) -> dict[str, float]:
    """Each mark from the rank that reached it last (the trial waits for the slowest rank)."""
    return {mark: max(r[mark] for r in per_rank) for mark in RANK_MARKS if all(mark in r for r in per_rank)}


def thread_figures(per_rank: list[dict]) -> dict:
    """Where the training threads' timed steps went, the rank that waited most: the share on a CPU,
    the share runnable without a core (the rest it was blocked: on the GPU, the GIL), the times it
    blocked; its CPU time a step, the kernel's part of it and its minor page faults a step; the CPU time a
    step of the rank's other threads, the busiest one's (on a GPU autograd's, which runs the backward
    pass) and all; the host time a step of forward, backward, the optimizer step and the rest of the loop;
    and torch's intra-op threads."""
    def worst(numerator: str, denominator: str, scale: float = 1.0, pick=max):
        shares = [r[numerator] / r[denominator] * scale for r in per_rank
                  if r.get(numerator) is not None and r.get(denominator)]
        return pick(shares) if shares else None

    on_cpu = [r["timed_thread_cpu_s"] / r["timed_s"] for r in per_rank if r.get("timed_thread_cpu_s")]
    return {"thread_on_cpu": min(on_cpu) if on_cpu else None,
            "thread_run_queue": worst("timed_run_queue_s", "timed_s"),
            "thread_blocks_per_step": worst("timed_voluntary_switches", "timed_steps"),
            "thread_cpu_ms_per_step": worst("timed_thread_cpu_s", "timed_steps", 1e3),
            "thread_kernel_share": worst("timed_thread_system_s", "timed_thread_cpu_s"),
            "thread_faults_per_step": worst("timed_minor_faults", "timed_steps"),
            "busiest_other_thread_cpu_ms_per_step": worst("timed_busiest_other_thread_cpu_s", "timed_steps", 1e3),
            "other_threads_cpu_ms_per_step": worst("timed_other_threads_cpu_s", "timed_steps", 1e3),
            "busiest_other_thread": per_rank[0].get("timed_busiest_other_thread"),
            # Same work, more CPU time: more instructions (another code path) or fewer a cycle, or a slower clock.
            "thread_minstructions_per_step": worst("timed_thread_instructions", "timed_steps", 1e-6),
            "thread_instructions_per_cycle": worst("timed_thread_instructions", "timed_thread_cycles", pick=min),
            # User-space cycles over all CPU time: the kernel's 0.1-0.5 % of it makes this a shade low.
            "thread_ghz": worst("timed_thread_cycles", "timed_thread_cpu_s", 1e-9, pick=min),
            **{f"{phase}_ms_per_step": worst(f"timed_{phase}_s", "timed_steps", 1e3)
               for phase in ("forward", "backward", "optimizer_step", "other")},
            "torch_threads": per_rank[0].get("torch_threads"),
            "thread_migrations_per_s": worst("timed_thread_migrations", "timed_s"),
            # RAY_ZERO_SPEED_PROBE=1 (ray_zero/speed_probe.py): fixed work, timed in the process after training.
            **{name: max((r[name] for r in per_rank if r.get(name) is not None), default=None)
               for name in ("probe_python_loop_ms", "probe_dispatch_us", "probe_gather_ms", "probe_anon_huge_mib",
                            "probe_rss_mib")}}


def _phases(marks: dict[str, float], phases) -> dict[str, float]:
    return {name: marks[end] - marks[start] for name, start, end in phases if start in marks and end in marks}


def start_up_figures(per_rank: list[dict]) -> dict[str, float]:
    """Seconds of each rank phase before the timed steps (slowest rank), the same under both launchers."""
    phases = _phases(_slowest_rank_marks(per_rank), RANK_PHASES[:-1])
    return {re.sub(r"\W+", "_", name).strip("_") + "_s": value for name, value in phases.items()}


def run_bare(experiment, point, precision: str, use_gpu: bool, workdir: Path,
             torchrun_args: tuple[str, ...] = (), env_overrides: Optional[dict[str, str]] = None) -> dict:
    """One grid point as bare DeepSpeed under torchrun; returns its row."""
    trial = {"experiment": experiment.model_dump(mode="json"), "point": point, "precision": precision,
             "use_gpu": use_gpu}
    trial_path, out_path = workdir / f"{trial_name(point)}.json", workdir / f"{trial_name(point)}.out.json"
    trial_path.write_text(json.dumps(trial))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={point['num_workers']}", *torchrun_args, str(ROOT / "bench" / "bare_deepspeed.py"),
               str(trial_path), str(out_path)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # as Ray gives a 1-CPU worker
           **(env_overrides or {})}
    launched_at = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    exited_at = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"bare run {trial_name(point)} failed:\n{done.stderr[-3000:]}")
    per_rank = json.loads(out_path.read_text())["ranks"]
    marks = {**_slowest_rank_marks(per_rank), "launched_at": launched_at, "exited_at": exited_at}
    return {"trial": trial_name(point), **aggregate_ranks(per_rank), "wall_s": exited_at - launched_at,
            "per_rank": per_rank,
            **{f"bare {k}": v for k, v in _phases(marks, BARE_PHASES).items()}}


def ray_rows(output: Path, serial: bool = False) -> dict[str, dict]:
    """The sweep's ok rows with their phases. `tune_wall_s` is the trial's wall time as Tune saw it, plus
    the start of its driver process if Tune started one for it (later trials reuse it). With `serial`
    (the sweep trained one trial at a time) it is instead the time since the previous trial's result:
    what each trial adds to the sweep, also when it started early and waited for the GPUs."""
    rows, seen_drivers, previous = {}, set(), None
    for row in sorted(load_trials(output), key=lambda r: r.get("tune_finished_at") or 0):
        if row.get("status") != "ok":
            continue
        marks = {**{k: row[k] for k in ("tune_started_at", "driver_started_at", "fit_started_at",
                                        "fit_finished_at", "tune_finished_at") if row.get(k)},
                 **_slowest_rank_marks(row["per_rank"])}
        if row["driver_pid"] not in seen_drivers:
            seen_drivers.add(row["driver_pid"])
            marks["driver_spawned_at"] = min(row["driver_process_started_at"], row["tune_started_at"])
        began = marks.get("driver_spawned_at", row["tune_started_at"])
        if serial and previous is not None:
            began = previous
            if row["fit_started_at"] < previous:
                # Started early: its driver and controller started during the previous trial, then waited.
                for overlapped in ("tune_started_at", "driver_started_at", "fit_started_at"):
                    marks.pop(overlapped, None)
                marks["previous_result_at"] = previous
        previous = row["tune_finished_at"]
        rows[row["trial"]] = {**row, "tune_started_at": began, "tune_wall_s": row["tune_finished_at"] - began,
                              **{f"ray {k}": v for k, v in _phases(marks, RAY_PHASES).items()}}
    return rows


def _ray_cpus(experiment, workers: int, use_gpu: bool) -> int:
    """CPUs of each private Ray: a trial's own, at least 2 with GPUs (the GPUs hold one trial at a time
    there); BENCH_RAY_CPUS=N sets it. Ray starts at most that many worker processes at once and prestarts
    as many at its start (ray/_private/services.py), where a user's private Ray has every CPU."""
    cpus = workers * experiment.cpus_per_worker
    return int(os.environ.get("BENCH_RAY_CPUS", max(2, cpus) if use_gpu else cpus))


def _sweep_alone(experiment, folder: Path, workers: int, use_gpu: bool, command: str) -> None:
    """Run `experiment` as a ray_zero sweep on a private Ray with room for exactly one trial of
    `workers` workers: its trials train one at a time, like the bare runs."""
    import ray

    ray.init(num_gpus=workers if use_gpu else 0, num_cpus=_ray_cpus(experiment, workers, use_gpu),
             dashboard_host="127.0.0.1", configure_logging=False)
    try:
        run_sweep(experiment, folder, command=command)
    finally:
        ray.shutdown()


def _provenance_lines(folder: Path) -> list[str]:
    """A sweep's provenance as Markdown list items, with this benchmark's command in place of the sweep's."""
    provenance = read_provenance(folder) or {}
    provenance["command"] = " ".join(["python", "bench/bench.py", *sys.argv[1:]])
    return [f"- {k}: {v}" for k, v in provenance.items() if k != "experiment"]


def _affinity() -> str:
    """The CPUs this process may run on (taskset pins it and every process it starts, Ray's included)."""
    cpus, total = sorted(os.sched_getaffinity(0)), os.cpu_count()
    return f"all {total}" if len(cpus) == total else f"{len(cpus)} of {total}: {','.join(map(str, cpus))}"


def require_new_output(parser: argparse.ArgumentParser, output: Path) -> None:
    """A benchmark's sweeps refuse a folder that holds results: refuse a non-empty --output up front."""
    if output.is_dir() and any(output.iterdir()):
        parser.error(f"--output {output} is not empty: give a new folder")


def compare(experiment, output: Path) -> pd.DataFrame:
    cluster = local_cluster()
    plan = plan_sweep(experiment, cluster)
    workdir = Path(tempfile.mkdtemp(prefix="bare-"))
    records = []
    for workers in sorted({p["num_workers"] for p in plan.runnable}):
        points = [p for p in plan.runnable if p["num_workers"] == workers]
        bare = {}
        for point in points:
            print(f"bench: bare DeepSpeed {trial_name(point)}", flush=True)
            bare[trial_name(point)] = run_bare(experiment, point, plan.precision, plan.use_gpu, workdir)
        print(f"bench: ray_zero sweep of the same {len(points)} points, on a Ray with room for one "
              f"{workers}-worker trial (trials train one at a time, like the bare runs)", flush=True)
        group = experiment.model_copy(update={"grid": experiment.grid.model_copy(update={"num_workers": [workers]})})
        _sweep_alone(group, output / "ray_zero" / f"w{workers}", workers, plan.use_gpu, "bench/bench.py")
        ray_side = ray_rows(output / "ray_zero" / f"w{workers}", serial=True)
        for order, (name, r) in enumerate(ray_side.items()):
            b = bare[name]
            records.append({
                "trial": name, "order_in_sweep": order + 1,
                "bare_samples_per_s": b["samples_per_s"], "ray_zero_samples_per_s": r["samples_per_s"],
                "samples_per_s_ratio": r["samples_per_s"] / b["samples_per_s"],
                "bare_wall_s": b["wall_s"], "ray_zero_wall_s": r["tune_wall_s"],
                "bare_overhead_s": b["wall_s"] - b["timed_s"], "ray_zero_overhead_s": r["tune_wall_s"] - r["timed_s"],
                "overhead_minus_bare_s": (r["tune_wall_s"] - r["timed_s"]) - (b["wall_s"] - b["timed_s"]),
                **{k: v for k, v in b.items() if k.startswith("bare ")},
                **{k: v for k, v in r.items() if k.startswith("ray ")},
            })
    return pd.DataFrame(records)


def _ray_row(folder: Path, name: str) -> dict:
    """The ray_zero run's row; a failed run stops the benchmark with its reason, not a KeyError."""
    rows = ray_rows(folder)
    if name not in rows:
        failed = [r for r in load_trials(folder) if r.get("trial") == name]
        reason = failed[0].get("error", "no result") if failed else "no result"
        raise RuntimeError(f"ray_zero run {name} in {folder} failed: {reason}")
    return rows[name]


def _timed_interval(row: dict) -> tuple[float, float]:
    """When the slowest rank's timed steps ran (wall clock)."""
    return row["finished_at"] - row["timed_s"], row["finished_at"]


def timed_overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Share of the longer of two (start, end) intervals during which the other ran too."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0])) / max(a[1] - a[0], b[1] - b[0])


def _side_by_side(experiment, single, point, plan, workdir: Path, folder: Path, repeat: int,
                  delay_s: float) -> tuple[dict, dict]:
    """Bare on one GPU and ray_zero on the other at the same time (swapped every repeat): both see the
    same state of a shared host. The bare run starts `delay_s` later, so that the timed steps coincide."""
    bare_gpu, ray_gpu = ("0", "1") if repeat % 2 == 1 else ("1", "0")
    env = {"CUDA_VISIBLE_DEVICES": bare_gpu} if plan.use_gpu else {}

    def bare_after_delay() -> dict:
        time.sleep(delay_s)
        return run_bare(experiment, point, plan.precision, plan.use_gpu, workdir, env_overrides=env)

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(bare_after_delay)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if plan.use_gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = ray_gpu  # the private Ray (raylet, workers) sees this GPU only
        try:
            _sweep_alone(single, folder, 1, plan.use_gpu, "bench/bench.py --throughput --side-by-side")
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        return pending.result(), _ray_row(folder, trial_name(point))


def throughput(experiment, output: Path, repeats: int, side_by_side: bool = False,
               bare_delay_s: float = 0.0) -> pd.DataFrame:
    """Steady-state samples/s only: each point `repeats` times, bare and ray_zero alternating, the first
    of each pair swapped every repeat (bare, ray_zero; ray_zero, bare; ...), so that a drift of the
    machine (clocks, neighbours, caches) hits both launchers alike; paired ratios per repeat."""
    plan = plan_sweep(experiment, local_cluster())
    workdir = Path(tempfile.mkdtemp(prefix="bare-"))
    records = []
    for point in plan.runnable:
        name = trial_name(point)
        single = experiment.model_copy(update={"grid": experiment.grid.model_copy(update={
            "stage": [point["stage"]], "micro_batch_size": [point["micro_batch_size"]],
            "num_workers": [point["num_workers"]]})})
        for repeat in range(1, repeats + 1):
            folder = output / "throughput" / f"{name}-{repeat}"
            if side_by_side:
                print(f"bench: throughput {name}, repeat {repeat}: bare and ray_zero at once, bare "
                      f"{bare_delay_s:.1f} s later", flush=True)
                bare, ray_side = _side_by_side(experiment, single, point, plan, workdir, folder, repeat,
                                               bare_delay_s)
                order = f"at once, bare +{bare_delay_s:.1f} s"
            else:
                bare_first = repeat % 2 == 1
                print(f"bench: throughput {name}, repeat {repeat}: "
                      f"{'bare, then ray_zero' if bare_first else 'ray_zero, then bare'}", flush=True)
                if bare_first:
                    bare = run_bare(experiment, point, plan.precision, plan.use_gpu, workdir)
                _sweep_alone(single, folder, point["num_workers"], plan.use_gpu, "bench/bench.py --throughput")
                if not bare_first:
                    bare = run_bare(experiment, point, plan.precision, plan.use_gpu, workdir)
                ray_side = _ray_row(folder, name)
                order = "bare" if bare_first else "ray_zero"
            (bare_start, bare_end), (ray_start, ray_end) = _timed_interval(bare), _timed_interval(ray_side)
            if side_by_side:  # next pair: shift the bare start so that both timed phases begin together
                bare_delay_s = max(0.0, bare_delay_s + ray_start - bare_start)
            records.append({"trial": name, "repeat": repeat, "first": order,
                            "bare_samples_per_s": bare["samples_per_s"],
                            "ray_zero_samples_per_s": ray_side["samples_per_s"],
                            "samples_per_s_ratio": ray_side["samples_per_s"] / bare["samples_per_s"],
                            "bare_timed_s": bare["timed_s"], "ray_zero_timed_s": ray_side["timed_s"],
                            # Each ray_zero run is a sweep's first trial: its overhead includes Tune's driver.
                            "bare_overhead_s": bare["wall_s"] - bare["timed_s"],
                            "ray_zero_first_trial_overhead_s": ray_side["tune_wall_s"] - ray_side["timed_s"],
                            "timed_overlap": timed_overlap((bare_start, bare_end), (ray_start, ray_end)),
                            # Epoch seconds: to read a host-speed trace (bench/speed_monitor.py) over each run.
                            "bare_timed_from": bare_start, "bare_timed_to": bare_end,
                            "ray_zero_timed_from": ray_start, "ray_zero_timed_to": ray_end,
                            **{f"{side}_{k}": v for side, row in (("bare", bare), ("ray_zero", ray_side))
                               for k, v in thread_figures(row["per_rank"]).items()},
                            **{f"{side}_{k}": v for side, row in (("bare", bare), ("ray_zero", ray_side))
                               for k, v in start_up_figures(row["per_rank"]).items()},
                            "bare_window_median": bare["window_samples_per_s_median"],
                            "ray_zero_window_median": ray_side["window_samples_per_s_median"],
                            **{f"{which}_ratio": ray_side[which] / bare[which] for which in
                               ("window_samples_per_s_median", "window_samples_per_s_p90")}})
            # Written after every pair, so that a run cut short by a time limit keeps what it measured.
            pd.DataFrame(records).to_csv(output / "throughput.csv", index=False)
    return pd.DataFrame(records)


def throughput_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per point: the median paired ratio, its spread, and each launcher's spread between repeats."""
    grouped = table.groupby("trial", sort=False)
    return pd.DataFrame({
        "repeats": grouped.size(),
        "median_ratio": grouped["samples_per_s_ratio"].median(),
        "median_ratio_of_window_medians": grouped["window_samples_per_s_median_ratio"].median(),
        "median_ratio_of_window_p90s": grouped["window_samples_per_s_p90_ratio"].median(),
        "min_ratio": grouped["samples_per_s_ratio"].min(),
        "max_ratio": grouped["samples_per_s_ratio"].max(),
        "bare_spread": grouped["bare_samples_per_s"].max() / grouped["bare_samples_per_s"].min(),
        "ray_zero_spread": grouped["ray_zero_samples_per_s"].max() / grouped["ray_zero_samples_per_s"].min(),
    }).reset_index()


def packing(experiment, output: Path) -> dict:
    """Eight 1-worker trials: how well does the sweep pack them onto the machine's GPUs (or CPUs)?"""
    # Without early starts: a trial's Tune wall time is then its own, not a wait for a free GPU.
    eight = experiment.model_copy(update={"overlap_startup": False, "grid": experiment.grid.model_copy(update={
        "stage": [0, 1], "micro_batch_size": [16, 32, 48, 64], "num_workers": [1]})})
    started = time.time()
    run_sweep(eight, output / "packing", command="bench/bench.py --packing")
    sweep_wall = time.time() - started
    rows = list(ray_rows(output / "packing").values())
    trials_wall = sum(r["tune_wall_s"] for r in rows)
    first, last = min(r["tune_started_at"] for r in rows), max(r["tune_finished_at"] for r in rows)
    return {"trials": len(rows), "sum_of_trial_walls_s": trials_wall, "first_start_to_last_finish_s": last - first,
            "sweep_wall_s_with_ray_start": sweep_wall, "ratio": (last - first) / trials_wall,
            "max_concurrent_trials": read_provenance(output / "packing")["max_concurrent_trials"]}


def _check_side_by_side(parser: argparse.ArgumentParser, args, experiment) -> None:
    """One line, before any Ray starts, for a side-by-side run that cannot be."""
    if not args.throughput:
        parser.error("--side-by-side measures samples/s only: give --throughput R as well")
    if experiment.grid.num_workers != [1]:
        parser.error(f"--side-by-side runs 1-worker points only (one GPU each side); grid.num_workers is "
                     f"{experiment.grid.num_workers}: add --set 'grid.num_workers=[1]'")
    cluster = local_cluster()
    if cluster.gpus < 2 and experiment.use_gpu(cluster.gpus > 0):
        parser.error(f"--side-by-side needs 2 GPUs, one for each side; this machine has {cluster.gpus}")
    if args.bare_delay < 0:
        parser.error(f"--bare-delay {args.bare_delay}: give 0 or more seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("experiment", nargs="?", default=str(ROOT / "experiments" / "quick.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="as for ray_zero sweep")
    parser.add_argument("--packing", action="store_true", help="also time a grid of eight 1-worker trials")
    parser.add_argument("--only-packing", action="store_true", help="time the eight 1-worker trials only")
    parser.add_argument("--throughput", type=int, metavar="R", default=0,
                        help="instead: samples/s only, each point R times, bare and ray_zero alternating")
    parser.add_argument("--side-by-side", action="store_true",
                        help="with --throughput and 1-worker points on 2 GPUs: bare on one GPU, ray_zero on the "
                             "other, at the same time")
    parser.add_argument("--bare-delay", type=float, default=15.0, metavar="S",
                        help="with --side-by-side: start the first bare run S seconds after the sweep (later "
                             "pairs adjust it so that the timed steps coincide); default 15")
    parser.add_argument("--output", type=Path, required=True, help="folder for bench.md, bench.csv, the sweeps")
    args = parser.parse_args()
    require_new_output(parser, args.output)
    experiment = load_experiment(args.experiment, args.overrides).with_absolute_data_dir()
    if args.side_by_side:
        _check_side_by_side(parser, args, experiment)
    args.output.mkdir(parents=True, exist_ok=True)
    lines = [f"# ray_zero vs bare DeepSpeed: {experiment.name}", ""]
    if args.throughput:
        table = throughput(experiment, args.output, args.throughput, args.side_by_side, args.bare_delay)
        table.to_csv(args.output / "throughput.csv", index=False)
        # Each pair's ray_zero run had a Ray of its own, sized for its trial: the first one's is no summary.
        per_run = ("- cluster:", "- max_concurrent_trials:", "- trials_started_early:")
        lines += [line for line in _provenance_lines(next((args.output / "throughput").iterdir()))
                  if not line.startswith(per_run)]
        lines.append("- each ray_zero run: a private Ray with room for exactly its one trial"
                     + (f" ({os.environ['BENCH_RAY_CPUS']} CPUs: BENCH_RAY_CPUS)" if "BENCH_RAY_CPUS" in os.environ else ""))
        lines.append(f"- cpus this benchmark and its children may use: {_affinity()}")
        switches = sorted(f"{k}={v}" for k, v in os.environ.items()
                          if k.startswith("BARE_") or k == "RAY_ZERO_SPEED_PROBE")
        if switches:  # bare_deepspeed.py's set-up switches and the speed probe, inherited by every run
            lines.append(f"- runs with: {' '.join(switches)}")
        if args.side_by_side:
            lines.append("- side by side: bare and ray_zero at the same time, each on a GPU of its own (swapped "
                         "every repeat); `timed_overlap` is the share of the timed steps that ran together")
        lines += ["", "## Steady-state samples/s, repeats alternating bare and ray_zero", "",
                  markdown_table(table, list(table.columns)), "", "## Per point", "",
                  markdown_table(summary := throughput_summary(table), list(summary.columns)), ""]
        atomic_write(args.output / "throughput.md", "\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    if not args.only_packing:
        table = compare(experiment, args.output)
        table.to_csv(args.output / "bench.csv", index=False)
        lines += _provenance_lines(next((args.output / "ray_zero").iterdir()))
        summary = ["trial", "order_in_sweep", "bare_samples_per_s", "ray_zero_samples_per_s", "samples_per_s_ratio",
                   "bare_wall_s", "ray_zero_wall_s", "bare_overhead_s", "ray_zero_overhead_s", "overhead_minus_bare_s"]
        lines += ["", "## Throughput and per-trial overhead", "", markdown_table(table, summary), ""]
        order = [f"bare {name}" for name, _, _ in BARE_PHASES] + [f"ray {name}" for name, _, _ in RAY_PHASES]
        phases = table.set_index("trial")[[c for c in order if c in table.columns]].T
        lines += ["## Where each trial's time went (seconds, slowest rank)", "",
                  markdown_table(phases.reset_index().rename(columns={"index": "phase"}), ["phase", *phases.columns]),
                  ""]
    if args.packing or args.only_packing:
        packed = packing(experiment, args.output)
        if args.only_packing:
            lines += [*_provenance_lines(args.output / "packing"), ""]
        lines += ["## Packing: eight 1-worker trials", ""]
        lines += [f"- {k}: {v:.3g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in packed.items()]
        with open(args.output / "packing.json", "w") as out:
            json.dump(packed, out, indent=1)
    atomic_write(args.output / "bench.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
