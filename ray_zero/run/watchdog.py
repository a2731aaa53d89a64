"""Every trial bounded: a trial whose own time (since its first rank began, waits for its GPU's turn left
out) passes its bound is stopped, its ranks' Python stacks kept, and its row says `timeout` with the
phase it was in.

Ray Tune has no per-trial time limit (ray-project/ray#47475), and a rank stuck in a collective still
answers Ray Train's health checks (training runs in a thread): only the process group's timeout would end
it (30 minutes by default). So the trial's driver watches it (`watch`, beside `fit()`), and past the bound
stops each rank with a task placed on its node (public Ray API): py-spy's dump of the process where
py-spy is installed, else the stack faulthandler writes when the rank gets SIGUSR1 (a stopped process is
continued first), then SIGKILL. Ray Train sees its workers die; a retry it starts gives up at once (the
trial log says the trial was stopped).

The worker group's start is bounded too: each Train worker process of the trial runs
`worker_setup_hook`'s function when it starts (Ray's `worker_process_setup_hook`, named by the sweep's job:
ray_zero/run/cluster.py; the trial named in the runtime environment Ray Train gives its workers), which
puts the process in the trial log, with its stacks on SIGUSR1, before Ray Train gives it a rank. A
process that never reaches its training function (its process group never forms, it hangs in an import,
it was stopped) is then stopped like a rank. The wait for the workers' resources (a trial started early
waits for another's GPUs) is not counted: no process of the trial exists yet.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import ray

from ray_zero.train.steps import COUNTED_STEPS

BOUND_FLOOR_S = 600.0
"""No trial's default bound is shorter: start-up on a loaded node, imports, a model built and copied."""
PESSIMISTIC_FLOPS = {"gpu": 20e12, "cpu": 5e9}
"""FLOP/s a worker surely reaches (a tenth of a slow device's): the default bound's step time."""
BOUND_FACTOR = 4.0
STACK_SIGNAL = signal.SIGUSR1
POLL_S = 1.0
TRIAL_KEY_VAR, TRIAL_LOG_VAR = "RAY_ZERO_TRIAL_KEY", "RAY_ZERO_TRIAL_LOG"
"""In a trial's Train workers' environment: the trial log's key and the log actor's name."""


def trial_bound_s(spec) -> Optional[float]:
    """The trial's bound in seconds (runtime.trial_timeout_s; "auto": the floor, or four times every step
    the trial may run, warm-up, added timed steps and counted steps included, at a pessimistic rate if
    longer); None: unbounded."""
    setting = spec.experiment.runtime.trial_timeout_s
    if setting is None or isinstance(setting, (int, float)):
        return setting
    experiment, point = spec.experiment, spec.point
    added = experiment.timing_max_steps  # timed steps in all, the warm-up's aside
    steps = max(experiment.steps or 0, experiment.warmup_steps + added if added else 0)
    if experiment.epochs:  # an epoch of the presets' 5,000 digits, shared by the ranks
        steps = experiment.epochs * max(1, 5000 // (point.micro_batch_size * point.num_workers))
    steps += COUNTED_STEPS
    samples = steps * point.micro_batch_size * experiment.gradient_accumulation_steps
    rate = PESSIMISTIC_FLOPS["gpu" if spec.use_gpu else "cpu"]
    return max(BOUND_FLOOR_S, BOUND_FACTOR * samples * spec.model.flops_per_sample / rate)


def stack_file(log_key: str, rank) -> Path:
    """Where a rank's faulthandler writes its stacks on SIGUSR1: its node's temporary folder (`rank`: the
    rank, or `_pidN` for a worker process without one)."""
    return Path(tempfile.gettempdir()) / "ray_zero-stacks" / f"{log_key}-rank{rank}.txt"


def worker_runtime_env(log_name: str, log_key: str) -> dict[str, Any]:
    """The runtime environment of a trial's Train workers: the trial and its log named, for the job's
    setup hook (`worker_setup_hook`, ray_zero/run/cluster.py's JOB_ENV)."""
    return {"env_vars": {TRIAL_KEY_VAR: log_key, TRIAL_LOG_VAR: log_name}}


def worker_setup_hook():
    """Ray's worker_process_setup_hook for the sweep's job (ray_zero/run/cluster.py): at a trial's Train
    worker process's start (its runtime environment names the trial), its stacks on SIGUSR1, then, from a
    thread once the process runs its actor (Ray 2.60 cannot submit a task from the hook itself: its core
    worker aborts), the process in the trial log, and a `.started` file beside its stack file. A
    function made here and sent by value: it imports nothing of ray_zero (a worker runs the hook before it
    can find a checkout's modules). Never raises: a worker starts whatever the log says."""
    key_var, log_var = TRIAL_KEY_VAR, TRIAL_LOG_VAR

    def worker_process_started() -> None:
        import faulthandler
        import os
        import signal
        import tempfile
        import threading
        import time
        from pathlib import Path

        import ray

        key, name = os.environ.get(key_var), os.environ.get(log_var)
        if not key or not name:
            return
        pid = os.getpid()
        stacks = Path(tempfile.gettempdir()) / "ray_zero-stacks" / f"{key}-rank_pid{pid}.txt"  # stack_file's
        try:
            stacks.parent.mkdir(parents=True, exist_ok=True)
            faulthandler.register(
                signal.SIGUSR1, file=open(stacks, "w"), all_threads=True
            )  # it keeps the file
        except OSError:
            return

        def register() -> None:
            try:
                context = ray.get_runtime_context()
                deadline = time.time() + 300
                while context.get_actor_id() is None and time.time() < deadline:
                    time.sleep(0.02)
                log = ray.get_actor(name)
                ray.get(log.process_started.remote(key, context.get_node_id(), pid), timeout=60)
                stacks.with_suffix(".started").touch()
            except Exception:  # noqa: BLE001  the log gone or slow: the rank's own start still registers it
                pass

        threading.Thread(target=register, name="ray_zero trial log", daemon=True).start()

    return worker_process_started


def keep_stacks_on_signal(log_key: str, rank):
    """In the rank's process: all threads' stacks to its stack file on SIGUSR1 (returns the open file,
    which must stay open)."""
    path = stack_file(log_key, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "w")
    faulthandler.register(STACK_SIGNAL, file=handle, all_threads=True)
    return handle


def _take_stacks(pid: int, path: str) -> str:
    """On the rank's node: its stacks (every thread's, as faulthandler writes them on SIGUSR1; py-spy's
    where that gave nothing), then the process frozen (SIGSTOP) so that it cannot end, or be ended by
    another rank's death, before every rank's stacks are taken."""
    try:
        os.kill(pid, signal.SIGCONT)  # a stopped process takes its signals once continued
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return "(the process had already ended)"
    deadline = time.time() + 5
    while time.time() < deadline and not (Path(path).is_file() and Path(path).stat().st_size):
        time.sleep(0.1)
    time.sleep(0.3)  # the other threads' stacks follow the first
    stacks = Path(path).read_text() if Path(path).is_file() else ""
    if not stacks and shutil.which("py-spy"):
        try:
            command = ["py-spy", "dump", "--pid", str(pid)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            stacks = done.stdout if done.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            stacks = ""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    return stacks or "(no stacks: neither the process's faulthandler nor py-spy answered)"


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _targets(progress: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The trial's ranks by rank, and its worker processes without a rank as `_pidN`."""
    ranks = {str(rank): r for rank, r in progress["ranks"].items() if r.get("pid")}
    return {**ranks, **{f"_pid{pid}": p for pid, p in progress.get("processes", {}).items()}}


def stop_ranks(progress: dict[str, Any], log_key: str) -> dict[str, str]:
    """Each rank's stacks, by rank (a task on each rank's node; `_pidN` for a worker process that had no
    rank yet), then every one killed: none is killed before all stacks are in, so none is lost to a
    peer's death."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ranks = _targets(progress)

    def on_node(function, rank):
        strategy = NodeAffinitySchedulingStrategy(ranks[rank]["node_id"], soft=True)
        return ray.remote(num_cpus=0)(function).options(scheduling_strategy=strategy)

    refs = {
        rank: on_node(_take_stacks, rank).remote(r["pid"], str(stack_file(log_key, rank)))
        for rank, r in ranks.items()
    }
    stacks = {}
    for rank, ref in sorted(refs.items()):
        try:
            stacks[rank] = ray.get(ref, timeout=90)
        except Exception as error:  # noqa: BLE001  its node is gone, or the task failed: say so
            stacks[rank] = f"(stacks not taken: {type(error).__name__}: {error})"
    kills = [on_node(_kill, rank).remote(r["pid"]) for rank, r in ranks.items()]
    ray.wait(kills, num_returns=len(kills), timeout=60)
    return stacks


def watch(fit: threading.Thread, log, log_key: str, bound_s: Optional[float]) -> Optional[dict[str, Any]]:
    """Wait for the run's `fit` thread; past the bound, stop the trial's ranks. Returns None, or what the
    row says of the timeout: the phase each rank was in, its stacks, the trial's own time."""
    timed_out = None
    while fit.is_alive():
        fit.join(POLL_S)
        if bound_s is None or timed_out is not None or not fit.is_alive():
            continue
        progress = ray.get(log.progress.remote(log_key))
        if progress is None or progress["own_s"] <= bound_s:
            continue
        ray.get(log.stop.remote(log_key))
        targets = _targets(progress)
        phases = {rank: r["phase"] for rank, r in progress["ranks"].items()}
        phases.update({who: r["phase"] for who, r in targets.items() if who.startswith("_pid")})
        timed_out = {
            "own_s": progress["own_s"],
            "ranks_started_at": min(r["started_at"] for r in (progress["ranks"] or targets).values()),
            "phases": phases,
            "stacks": stop_ranks(progress, log_key),
        }
    return timed_out


def lost_nodes(progress: Optional[dict[str, Any]]) -> list[str]:
    """The nodes of the trial's ranks that Ray no longer counts alive, as "NODE_ID (IP)"."""
    if not progress:
        return []
    alive = {n["NodeID"]: n for n in ray.nodes()}
    mine = {r.get("node_id") for r in progress["ranks"].values()} - {None}
    return sorted(
        f"{node[:12]} ({alive[node].get('NodeManagerAddress', '?')})" if node in alive else node[:12]
        for node in mine
        if not alive.get(node, {}).get("Alive", False)
    )


def unplaceable(spec) -> Optional[str]:
    """Why the live cluster cannot hold the trial's workers at all (a node lost), or None. Ray would keep
    the request waiting for resources that are gone."""
    total = ray.cluster_resources()  # the live nodes'
    cpus = spec.point.num_workers * spec.experiment.runtime.cpus_per_worker
    gpus = spec.point.num_workers * spec.gpu_share if spec.use_gpu else 0
    if total.get("CPU", 0) + 1e-9 >= cpus and total.get("GPU", 0) + 1e-9 >= gpus:
        return None
    return (
        f"needs {spec.point.num_workers} workers ({cpus} CPUs{f', {gpus:g} GPUs' if gpus else ''}); the "
        f"cluster's live nodes have {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs (a node lost?)"
    )


def timeout_fields(timed_out: dict[str, Any], bound_s: float) -> dict[str, Any]:
    """The row of a trial stopped past its bound."""
    phases = timed_out["phases"]
    # Steps are told at most once a second: a rank last heard of at step N is at step N or later.
    where = "; ".join(
        f"{_who(rank)}: {phase}{' or later' if phase.startswith('step ') else ''}"
        for rank, phase in sorted(phases.items(), key=lambda item: str(item[0]))
    )
    return {
        "status": "timeout",
        "error": f"stopped after {timed_out['own_s']:.0f} s, past its bound of {bound_s:.0f} s ({where}); "
        "the ranks' stacks are in the trial's stacks/ folder",
        "stacks": timed_out["stacks"],
        "ranks_started_at": timed_out["ranks_started_at"],
    }


def _who(rank) -> str:
    return f"worker pid {str(rank)[4:]} (no rank yet)" if str(rank).startswith("_pid") else f"rank {rank}"
