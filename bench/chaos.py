"""A sweep under fire: a grid of 32 short trials on a two-node local cluster (bench/local_cluster.py) while a
killer, every few seconds, kills a rank, stops one in training (SIGSTOP: a hung rank), or loses the worker
node (and brings it back); and once kills the sweep's own process (SIGKILL), which is then resumed. Like
Ray's release chaos tests (release/nightly_tests/setup_chaos.py), it asks whether every trial still
reaches its end. The story and figures: bench/chaos.md.

    nice -n 19 python bench/chaos.py --output OUT [--every 20] [--quiet-first]

Prints, and writes to OUT/chaos.md (and chaos.json): points planned, rows written, duplicates (a trial
with more than one row), lost (a point without a row), leaked (placement groups and actors still alive
on the cluster after the sweep, by Ray's public state API, and this cluster's Ray Train worker
processes), the faults injected, the rows' statuses, and the wall time against a quiet run of the same
grid on the same cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
from common import ROOT

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from local_cluster import ENV, cluster_processes, local_cluster, start_node, stop_node  # noqa: E402

from ray_zero.store import load_trials  # noqa: E402

# 4 stages x 4 micro-batches x 1-2 workers: 32 short trials of the tutorial's model on synthetic batches.
GRID = [
    "steps=6",
    "warmup_steps=2",
    "dataset=synthetic",
    "grid.stage=[0, 1, 2, 3]",
    "grid.micro_batch_size=[8, 16, 32, 64]",
    "grid.num_workers=[1, 2]",
    "runtime.max_failures=1",
    "runtime.trial_timeout_s=60",
]
POINTS = [f"stage{s}_mb{m}_w{w}" for s in (0, 1, 2, 3) for m in (8, 16, 32, 64) for w in (1, 2)]


def sweep_command(output: Path, address: str, resume: bool = False) -> list[str]:
    if resume:
        return [sys.executable, "-m", "ray_zero", "sweep", "--resume", str(output), "--address", address]
    command = [sys.executable, "-m", "ray_zero", "sweep", "experiments/quick.yaml", "--output", str(output)]
    command += ["--address", address]
    for override in GRID:
        command += ["--set", override]
    return command


def train_workers(cluster: dict) -> list[psutil.Process]:
    """This cluster's ranks (a Ray Train worker of another Ray on the machine is never touched)."""
    found = []
    for p in cluster_processes(cluster):
        try:
            if "RayTrainWorker" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def say(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", flush=True)


class Killer(threading.Thread):
    """Every `every` seconds one fault, in turn: a rank killed (SIGKILL), a rank stopped (SIGSTOP: hung),
    the worker node lost (and back after `every` seconds); the sweep's process killed once, at
    `kill_driver_at` seconds. A rank's fault waits (up to `every` s more) for a rank to be alive; a fault
    that finds none is tried again at the next turn, so every kind comes round."""

    KINDS = ("kill a rank", "stop a rank", "lose the worker node")

    def __init__(self, cluster: dict, every: float, sweep: "Sweep", kill_driver_at: float):
        super().__init__(daemon=True)
        self.cluster, self.every, self.sweep, self.kill_driver_at = cluster, every, sweep, kill_driver_at
        self.faults: list[tuple[float, str]] = []
        self.done = threading.Event()
        self.random = random.Random(0)
        self.started = time.time()

    def note(self, text: str) -> None:
        now = time.time() - self.started
        self.faults.append((round(now, 1), text))
        say(f"{now:.0f} s: {text}")

    def ranks(self, training: bool) -> list[psutil.Process]:
        """This cluster's ranks (with `training`: those in ray_zero's training function, i.e. holding their
        stacks file open), waiting up to `every` s for one (a trial between its ranks' lives)."""
        deadline = time.time() + self.every
        while not self.done.is_set():
            workers = [w for w in train_workers(self.cluster) if _status(w) != psutil.STATUS_STOPPED]
            if training:
                workers = [w for w in workers if _in_training(w)]
            if workers or time.time() > deadline:
                return workers
            time.sleep(0.5)
        return []

    def run(self) -> None:
        turn = 0
        while not self.done.wait(self.every):
            now = time.time() - self.started
            if self.kill_driver_at and now >= self.kill_driver_at and self.sweep.kill():
                self.note("the sweep's process killed (SIGKILL)")
                self.kill_driver_at = 0
                continue
            kind = self.KINDS[turn % len(self.KINDS)]
            if kind == "lose the worker node":
                alive = len(train_workers(self.cluster))
                killed = stop_node(self.cluster, 0)
                self.note(f"{kind} ({alive} ranks alive, {killed} processes killed)")
                self.done.wait(self.every)
                say(f"worker node back: {start_node(self.cluster, 0)}")
            else:
                # A rank is stopped mid-trial (in training); one stopped while Ray Train starts its
                # worker group is never bounded (bench/chaos.md, "found"): not tried here.
                workers = self.ranks(training=kind == "stop a rank")
                if not workers:
                    say(f"{kind}: no rank alive; again at the next turn")
                    continue
                victim = self.random.choice(workers)
                try:
                    victim.send_signal(signal.SIGKILL if kind == "kill a rank" else signal.SIGSTOP)
                except psutil.NoSuchProcess:
                    continue
                self.note(f"{kind} (pid {victim.pid}, {len(workers)} ranks alive)")
            turn += 1


def _in_training(process: psutil.Process) -> bool:
    """In ray_zero's training function: the rank holds its stacks file (ray_zero/run/watchdog.py) open."""
    try:
        return any("ray_zero-stacks" in f.path for f in process.open_files())
    except psutil.Error:
        return False


def _status(process: psutil.Process) -> str:
    try:
        return process.status()
    except psutil.Error:
        return "gone"


class Sweep:
    """The sweep's process: started, killed once, resumed until it ends."""

    def __init__(self, output: Path, address: str, log: Path):
        self.output, self.address, self.log = output, address, log
        self.process = None
        self.killed = False
        self.stopping = False
        self.lock = threading.Lock()

    def run(self) -> None:
        resume = False
        while True:
            with self.lock, open(self.log, "a") as log:
                if self.stopping:
                    return
                command = sweep_command(self.output, self.address, resume)
                self.process = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=log, stderr=log)
            code = self.process.wait()
            say(f"sweep process exited: {code}")
            if code == -signal.SIGKILL or code == 130:
                resume = True  # killed: finish it, as a user would
                continue
            return

    def kill(self, last: bool = False) -> bool:
        """SIGKILL the sweep's process (to be resumed; `last`: not)."""
        with self.lock:
            self.stopping = self.stopping or last
            if self.process is None or self.process.poll() is not None:
                return False
            self.process.send_signal(signal.SIGKILL)
            self.killed = True
            return True


def leaks(cluster: dict) -> dict[str, int]:
    """ray_zero's placement groups and actors still alive on the cluster, and its worker processes."""
    os.environ["RAY_AUTH_MODE"] = "token"  # the cluster's (local_cluster.ENV): else ray.init is refused
    import ray
    from ray.util.state import list_actors, list_placement_groups

    ray.init(address=cluster["address"], log_to_driver=False)
    try:
        groups = [
            g
            for g in list_placement_groups(limit=10_000)
            if g.state in ("CREATED", "PENDING", "RESCHEDULING")
        ]
        # Every live actor is a leak, but Ray Data's autoscaling coordinator (one per cluster, detached).
        actors = [
            a
            for a in list_actors(limit=10_000)
            if a.state == "ALIVE" and a.class_name != "_AutoscalingCoordinatorActor"
        ]
    finally:
        ray.shutdown()
    for leaked in [*groups, *actors]:
        say(f"leaked: {leaked}")
    ranks = train_workers(cluster)
    return {"placement groups": len(groups), "actors": len(actors), "worker processes": len(ranks)}


def leaks_or_error(cluster: dict):
    try:
        return leaks(cluster)
    except Exception as error:  # the figures so far are kept; the table says why this one is missing
        say(f"leak check failed: {error!r}")
        return {"error": repr(error)}


def measure(cluster: dict, output: Path, chaos: bool, every: float) -> dict:
    sweep = Sweep(output, cluster["address"], output.parent / f"{output.name}.log")
    killer = Killer(cluster, every, sweep, kill_driver_at=4 * every) if chaos else None
    say(f"{output.name}: started")
    started = time.time()
    runner = threading.Thread(target=sweep.run, daemon=True)
    runner.start()
    if killer:
        killer.start()
    try:
        runner.join()
    except BaseException:  # interrupted: the sweep's process goes too (the cluster goes with the context)
        sweep.kill(last=True)
        raise
    wall = time.time() - started
    if killer:
        killer.done.set()
        killer.join()
    for process in train_workers(cluster):  # a rank stopped as the sweep ended: continue it, so it can end
        process.send_signal(signal.SIGCONT)
    time.sleep(10)  # Ray's own clean-up of the run's actors and groups
    lines = []
    for line in (output / "trials.jsonl").read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a half-written row: load_trials skips it too
    counts = Counter(row["trial"] for row in lines)
    rows = load_trials(output)
    return {
        "wall_s": round(wall, 1),
        "rows": len(rows),
        "lost": sorted(set(POINTS) - {row["trial"] for row in rows}),
        "duplicates": sum(n - 1 for n in counts.values()),
        "statuses": dict(Counter(row["status"] for row in rows)),
        "not ok": {r["trial"]: f"{r['status']}: {r.get('error')}" for r in rows if r["status"] != "ok"},
        "attempts": dict(Counter(row.get("attempts") for row in rows)),
        "leaked": leaks_or_error(cluster),
        "faults": killer.faults if killer else [],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between faults")
    parser.add_argument("--quiet-first", action="store_true", help="also run the grid without faults")
    args = parser.parse_args(argv)
    output = args.output.resolve()
    output.mkdir(parents=True, exist_ok=True)
    planned = len(POINTS)
    results = {}
    with local_cluster(extra_nodes=1, cpus_per_node=2) as cluster:
        if args.quiet_first:
            results["quiet"] = measure(cluster, output / "quiet", chaos=False, every=args.every)
            say(f"quiet: {results['quiet']}")
            (output / "chaos.json").write_text(json.dumps(results, indent=1, default=str))
        results["chaos"] = measure(cluster, output / "chaos", chaos=True, every=args.every)
    lines = [
        "# chaos.py",
        "",
        f"- command: python bench/chaos.py {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"- grid: quick.yaml with {' '.join(GRID)}; points planned: {planned}",
        "",
    ]
    lines += [
        "| run | wall s | rows | lost | duplicates | leaked | statuses | faults |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        faults = Counter(kind.split(" (")[0] for _, kind in r["faults"])
        lines.append(
            f"| {name} | {r['wall_s']} | {r['rows']} | {len(r['lost'])} | {r['duplicates']} | "
            f"{r['leaked']} | {r['statuses']} | {dict(faults)} |"
        )
    text = "\n".join(lines)
    (output / "chaos.md").write_text(text + "\n")
    (output / "chaos.json").write_text(json.dumps(results, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
