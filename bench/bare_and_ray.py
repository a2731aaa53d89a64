"""One trial both ways, for bench/bench.py and bench/startup_profile.py: as bare DeepSpeed under torchrun
(bench/bare_deepspeed.py: the same ray_zero.train.worker.train, no Ray) and as a ray_zero sweep's trial on
a private Ray with room for exactly one; each with its wall-clock marks and where its time went.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT

sys.path.insert(0, str(ROOT))

from ray_zero.config import TrialSpec  # noqa: E402
from ray_zero.models.describe import describe_model  # noqa: E402
from ray_zero.rows import aggregate_ranks  # noqa: E402
from ray_zero.run.plan import local_cluster, plan_sweep  # noqa: E402
from ray_zero.run.sweep import run_sweep  # noqa: E402
from ray_zero.store import load_trials  # noqa: E402

# A trial's life as a chain of (phase, from mark, to mark). Marks are wall-clock times: each rank's
# (ray_zero/measure/diagnostics.py, taken inside ray_zero.train.worker.train under both launchers), the
# trial driver's
# (fit_*), the sweep's (recorded_at, began_at) and, for bare runs, this process's (launched_at, exited_at).
RANK_PHASES = [
    ("model build", "train_loop_started_at", "model_build_at"),
    ("data load", "model_build_at", "data_load_at"),
    ("engine set-up (deepspeed.initialize)", "data_load_at", "initialize_at"),
    ("warm-up steps", "initialize_at", "warmed_up_at"),
    ("timed steps", "warmed_up_at", "finished_at"),
]
BARE_PHASES = [
    ("torchrun: launch processes", "launched_at", "process_started_at"),
    ("worker: Python, imports, process group", "process_started_at", "train_loop_started_at"),
    *RANK_PHASES,
    ("write results, exit", "finished_at", "exited_at"),
]
RAY_PHASES = [
    ("tune: previous trial's row (first: the sweep's call) to fit()", "began_at", "fit_started_at"),
    ("train: controller, placement group, worker processes", "fit_started_at", "process_started_at"),
    ("worker: Python, Ray, train context, process group", "process_started_at", "train_loop_started_at"),
    *RANK_PHASES,
    ("train: report, shut workers down", "finished_at", "fit_finished_at"),
    ("tune: result to the sweep's row", "fit_finished_at", "recorded_at"),
]


def slowest_rank(ranks: list[dict]) -> dict[str, float]:
    """Each mark from the rank that reached it last: a trial waits for its slowest rank."""
    names = {k for r in ranks for k in r if k.endswith("_at")}
    return {
        k: max(r[k] for r in ranks) for k in names if all(isinstance(r.get(k), (int, float)) for r in ranks)
    }


def phases(marks: dict[str, float], chain, prefix: str) -> dict[str, float]:
    """Seconds of each phase. A mark earlier than the one before it (a worker process Ray had started
    beforehand, a trial started early that then waited) counts from that one: the phases add up to the
    first mark's time to the last's, what the trial added to the run."""
    out, reached = {}, None
    for name, start, end in chain:
        if start in marks and end in marks:
            begin = max(marks[start], reached if reached is not None else marks[start])
            reached = max(marks[end], begin)
            out[f"{prefix} {name}"] = reached - begin
    return out


def only(experiment, **grid):
    """`experiment` with some grid lists replaced (a value becomes a one-element list)."""
    lists = {k: v if isinstance(v, list) else [v] for k, v in grid.items()}
    return experiment.model_copy(update={"grid": experiment.grid.model_copy(update=lists)})


def plan_and_model(experiment):
    """What a sweep on this whole machine would run (points, device, precision), and the model's figures."""
    model = describe_model(experiment.model_source())
    return plan_sweep(experiment, local_cluster()), model


def bare_spec(experiment, point, plan, model, workdir: Path) -> TrialSpec:
    """What a ray_zero trial's ranks get for this point, diagnostics on (sweep.Session.spec)."""
    return TrialSpec(experiment, point, plan.precision, plan.use_gpu, model, str(workdir), diagnostics=True)


def run_bare(spec: TrialSpec, workdir: Path, torchrun_args=(), env=None) -> dict:
    """One trial as bare DeepSpeed under torchrun; its ranks aggregated as ray_zero aggregates them."""
    folder = Path(tempfile.mkdtemp(prefix=f"{spec.name}-", dir=workdir))
    (folder / "spec.pkl").write_bytes(pickle.dumps(spec))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={spec.point.num_workers}",
        *torchrun_args,
        str(ROOT / "bench" / "bare_deepspeed.py"),
        str(folder / "spec.pkl"),
        str(folder),
    ]
    # Ray sets OMP_NUM_THREADS to a worker's CPUs; torchrun would set 1 with a warning.
    threads = str(spec.experiment.runtime.cpus_per_worker)
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
        **(env or {}),
    }
    launched_at = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    exited_at = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"bare run {spec.name} failed:\n{done.stderr[-3000:]}")
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(spec.point.num_workers)]
    marks = {
        **slowest_rank([r["diagnostics"] for r in ranks]),
        "launched_at": launched_at,
        "exited_at": exited_at,
    }
    return {
        "trial": spec.name,
        **aggregate_ranks(ranks),
        "wall_s": exited_at - launched_at,
        "marks": marks,
        **phases(marks, BARE_PHASES, "bare"),
    }


def sweep_alone(experiment, folder: Path, workers: int, use_gpu: bool, command: str) -> float:
    """A ray_zero sweep on a private Ray with room for exactly one trial of `workers` workers, so that its
    trials run one at a time, as the bare runs do. Returns when the sweep was called (after ray.init)."""
    import ray

    cpus = workers * experiment.runtime.cpus_per_worker
    # With GPUs the GPUs allow one trial at a time, and 2 CPUs at least: Ray starts no more worker processes
    # at once than it has CPUs, and a trial starts several (its driver, controller, workers).
    ray.init(
        num_cpus=max(2, cpus) if use_gpu else cpus,
        num_gpus=workers if use_gpu else 0,
        dashboard_host="127.0.0.1",
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        called_at = time.time()
        run_sweep(experiment, folder, command=command, diagnostics=True)
    finally:
        ray.shutdown()
    return called_at


def ray_rows(folder: Path, called_at: float) -> list[dict]:
    """The sweep's trials in the order their rows were recorded, each with what it added to the sweep:
    from the previous trial's row (the first trial: from the sweep's call) to its own."""
    rows = sorted(
        (r for r in load_trials(folder) if r["status"] != "skipped"), key=lambda r: r["recorded_at"]
    )
    out, began = [], called_at
    for row in rows:
        if row["status"] != "ok":
            raise RuntimeError(
                f"ray_zero trial {row['trial']} in {folder}: {row['status']}: {row.get('error')}"
            )
        marks = {**slowest_rank(row["diagnostics"]), "began_at": began, "recorded_at": row["recorded_at"]}
        out.append(
            {
                **row,
                "ray_zero_wall_s": row["recorded_at"] - began,
                "marks": marks,
                **phases(marks, RAY_PHASES, "ray"),
            }
        )
        began = row["recorded_at"]
    return out


def pair(bare: dict, ray_side: dict) -> dict:
    """The comparison columns of one trial (the earlier bench.csv's names and meanings)."""
    bare_overhead, ray_overhead = (
        bare["wall_s"] - bare["timed_s"],
        ray_side["ray_zero_wall_s"] - ray_side["timed_s"],
    )
    return {
        "trial": ray_side["trial"],
        "num_workers": ray_side["num_workers"],
        "bare_samples_per_s": bare["samples_per_s"],
        "ray_zero_samples_per_s": ray_side["samples_per_s"],
        "samples_per_s_ratio": ray_side["samples_per_s"] / bare["samples_per_s"],
        "bare_wall_s": bare["wall_s"],
        "ray_zero_wall_s": ray_side["ray_zero_wall_s"],
        "bare_timed_s": bare["timed_s"],
        "ray_zero_timed_s": ray_side["timed_s"],
        "bare_overhead_s": bare_overhead,
        "ray_zero_overhead_s": ray_overhead,
        "overhead_minus_bare_s": ray_overhead - bare_overhead,
    }

