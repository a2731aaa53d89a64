"""Trials side by side on one GPU: the memory rule (run/gpu_sharing.py, pure) and the measurement turn
(train/turn.py) at rank level: no two trials' warm-up or timed steps overlap on one device."""

from __future__ import annotations

import fcntl
import itertools
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
from rank_group import describe, experiment_of, train_rank, trial_spec

from ray_zero.config import Point
from ray_zero.measure.prediction import GIB
from ray_zero.rows import trial_row
from ray_zero.run import gpu_sharing
from ray_zero.run.gpu_sharing import gpu_shares, memory_need
from ray_zero.train.turn import MeasurementTurn

ROOT = Path(__file__).resolve().parents[1]
H200_BYTES = 139.8 * GIB


def _gpt2_rows(precision="bf16", points=None):
    """Rows of GPT-2 small (seq 1024, as experiments/gpt2_zero.yaml), on GPU, at the given points."""
    experiment = experiment_of(ROOT / "experiments" / "gpt2_zero.yaml", f"precision={precision}")
    points = points or [Point("deepspeed", s, m, 1) for s in (0, 1, 2) for m in (4, 8, 16)]
    rows = {}
    for point in points:
        spec = trial_spec(experiment, point)
        row = trial_row(spec)
        row.update(precision=precision, memory_kind="cuda")
        rows[spec.name] = row
    return rows, describe(experiment)


def _residents(rows, needs, shares):
    """Check the rule on every set of trials whose shares fit one GPU: their residents and contexts, plus
    the largest step above a resident among the shared points, fit in the usable memory."""
    usable = gpu_sharing.USABLE_FRACTION * H200_BYTES
    shared = [n for n, s in shares.items() if s < 1]

    def need(n, kind):
        return gpu_sharing.RESERVED_FACTOR * getattr(needs[n], kind) + gpu_sharing.CONTEXT_BYTES

    step = max(need(n, "peak") - need(n, "resident") for n in shared)
    checked = 0
    for size in range(2, len(shared) + 1):
        for group in itertools.combinations(shared, size):
            if sum(shares[n] for n in group) <= 1.0:
                checked += 1
                assert sum(need(n, "resident") for n in group) + step <= usable * (1 + 1e-9), group
    return checked


def test_gpt2_grid_and_its_calibration_share_one_h200_within_its_memory():
    rows, model = _gpt2_rows()
    calibration = [Point("deepspeed", 0, m, 1, False) for m in (2, 4, 6)]
    cal_rows, _ = _gpt2_rows(points=calibration)
    rows.update({f"{n}_calibration": r for n, r in cal_rows.items()})
    # Before calibration: the meta count of autograd's saved bytes, an upper bound, for every point.
    needs = {n: memory_need(r, None, model.saved_bytes_per_sample) for n, r in rows.items()}
    assert all(n.basis == "uncalibrated upper bound" for n in needs.values())
    assert all(n.resident < n.peak for n in needs.values())
    sharing = gpu_shares(needs, {n: 1 for n in rows}, H200_BYTES, 1, max_per_gpu=6)
    assert all(0 < s < 1 for s in sharing.shares.values()), sharing.shares
    assert sharing.at_once == 6 and "up to 6 at once on 1 GPU, measured one at a time" == sharing.describe(1)
    assert _residents(rows, needs, sharing.shares) > 50
    # A larger micro-batch reserves no less, and the cap holds: at most 6 on the GPU.
    assert sharing.shares["stage0_mb16_w1"] >= sharing.shares["stage0_mb4_w1"] >= 1 / 6 - 1e-3


def test_calibrated_activations_replace_the_upper_bound():
    rows, model = _gpt2_rows(points=[Point("deepspeed", 1, 8, 1)])
    (name, row), = rows.items()
    calibration = {"by_backend": {"deepspeed": {"plain": 0.5 * GIB}}}
    calibrated = memory_need(row, calibration, model.saved_bytes_per_sample)
    upper = memory_need(row, None, model.saved_bytes_per_sample)
    assert calibrated.basis != "uncalibrated upper bound" and calibrated.peak < upper.peak
    assert calibrated.resident == pytest.approx(upper.resident)


def test_near_the_gpus_memory_or_unpredicted_runs_alone_and_two_workers_never_share_a_gpu():
    rows, model = _gpt2_rows(points=[Point("deepspeed", 0, 4, 1), Point("deepspeed", 1, 4, 2)])
    needs = {n: memory_need(r, None, model.saved_bytes_per_sample) for n, r in rows.items()}
    # Without any activation estimate (no calibration, no meta count) nothing is predicted: alone.
    assert memory_need(rows["stage0_mb4_w1"], None, None) is None
    workers = {"stage0_mb4_w1": 1, "stage1_mb4_w2": 2, "x": 1}
    unknown = gpu_shares({**needs, "x": None}, workers, H200_BYTES, 2, 6)
    assert unknown.shares["x"] == 1.0 and "1 alone" in unknown.describe(2)
    # A worker of a 2-worker trial takes over half a GPU: Ray cannot put both on one GPU.
    assert 0.5 < unknown.shares["stage1_mb4_w2"] < 1
    assert unknown.shares["stage0_mb4_w1"] < 0.5
    # On a GPU a fifth the size, the 1-worker point's peak nears the memory: it runs alone.
    small = gpu_shares(needs, workers, needs["stage0_mb4_w1"].peak * 1.2, 1, 6)
    assert small.shares["stage0_mb4_w1"] == 1.0 and small.at_once == 1


def _measure_in_turn(folder: str, key: str, seconds: float, queue) -> None:
    with MeasurementTurn(key, Path(folder)):
        started = time.time()
        queue.put(("taken", started))
        time.sleep(seconds)
        queue.put(("span", (started, time.time())))


def test_turns_serialise_across_processes_and_a_dead_holder_lets_go(tmp_path):
    context = mp.get_context("fork")  # the lock alone: no torch in these processes
    queue = context.Queue()
    workers = [
        context.Process(target=_measure_in_turn, args=(str(tmp_path), "gpu-x", 0.3, queue)) for _ in range(3)
    ]
    for w in workers:
        w.start()
    messages = [queue.get(timeout=60) for _ in range(2 * len(workers))]
    spans = sorted(value for kind, value in messages if kind == "span")
    for w in workers:
        w.join(30)
    assert all(a_end <= b_start + 1e-3 for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    # A holder killed (SIGKILL) hands the turn on: the kernel drops its lock.
    holder = context.Process(target=_measure_in_turn, args=(str(tmp_path), "gpu-x", 600, queue))
    holder.start()
    assert queue.get(timeout=60)[0] == "taken"
    holder.kill()
    holder.join(30)
    turn = MeasurementTurn("gpu-x", tmp_path)
    turn.acquire()
    turn.release()
    assert turn.waited_s < 5


def _waiting_on(path: Path) -> int:
    """Processes blocked on the flock of `path`."""
    inode = path.stat().st_ino
    lines = Path("/proc/locks").read_text().splitlines()
    return sum("->" in line and line.split()[-3].endswith(f":{inode}") for line in lines)


def _trial_in_turns(folder: str, key: str, name: str, after_waiting: bool, queue) -> None:
    """A trial's set-up (0.3 s) and measurement (0.3 s) in turns, its spans put on `queue`."""
    turn = MeasurementTurn(key, Path(folder))
    with turn.setting_up(after_waiting):
        started = time.time()
        time.sleep(0.3)
        queue.put((name, "set_up", started, time.time()))
    with turn:
        started = time.time()
        time.sleep(0.3)
        queue.put((name, "measured", started, time.time()))
    queue.put((name, "waited", turn.waited_s, None))


def _wait_until(condition, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_trials_that_come_while_others_wait_for_their_turn_set_up_together_after_them(tmp_path):
    """While a set-up trial waits for its turn, trials that come wait to set up, then set up side by
    side in one gap after it has measured; a trial with ranks on other devices (after_waiting=False)
    sets up at once."""
    context = mp.get_context("fork")  # the locks alone: no torch in these processes
    queue = context.Queue()

    def start(name: str, after_waiting: bool = True):
        process = context.Process(
            target=_trial_in_turns, args=(str(tmp_path), "gpu-x", name, after_waiting, queue)
        )
        process.start()
        return process

    spans = {}

    def next_span():
        name, kind, began, ended = queue.get(timeout=60)
        spans[name, kind] = (began, ended)
        return name, kind

    tmp_path.mkdir(exist_ok=True)
    turn = os.open(tmp_path / "gpu-x.turn", os.O_RDWR | os.O_CREAT)
    fcntl.flock(turn, fcntl.LOCK_EX)  # the GPU's turn taken: set-ups may go on, no measuring
    try:
        processes = [start("ready")]
        assert next_span() == ("ready", "set_up")
        assert _wait_until(lambda: _waiting_on(tmp_path / "gpu-x.turn") == 1)
        processes += [start("later-1"), start("later-2"), start("spread", after_waiting=False)]
        assert next_span() == ("spread", "set_up")
        assert _wait_until(lambda: _waiting_on(tmp_path / "gpu-x.ready") == 2)
    finally:
        fcntl.flock(turn, fcntl.LOCK_UN)
        os.close(turn)
    for _ in range(6 + 4):
        next_span()
    for process in processes:
        process.join(30)
    measured = spans["ready", "measured"]
    later_set_ups = [spans[name, "set_up"] for name in ("later-1", "later-2")]
    assert all(began >= measured[1] - 1e-3 for began, _ in later_set_ups), (later_set_ups, measured)
    (first, first_end), (second, _) = sorted(later_set_ups)
    assert second < first_end  # side by side, in one gap
    # The seconds waited, before the set-up and for the turn: the later ones waited through the measuring.
    waited = {name: spans[name, "waited"][0] for name in ("ready", "later-1", "later-2", "spread")}
    assert min(waited["later-1"], waited["later-2"]) >= measured[1] - measured[0] - 0.05, waited


def train_in_turns(rank: int, world_size: int, spec, folder: str, keys: list[str]) -> dict:
    """A rank of a trial whose rank r trains on the device `keys[r]` (a GPU each, as Ray places them)."""
    return train_rank(rank, world_size, spec, turn=MeasurementTurn(keys[rank], Path(folder)))


def test_no_trial_sets_up_or_measures_while_another_measures_on_its_device(ranks, tmp_path):
    """Two trials on device "a" (a 1-rank trial; a 2-rank trial whose other rank has device "b"), while
    the test measures on "a": both wait before setting up there; then they set up side by side and
    measure one after the other, neither setting up while the other measures."""
    experiment = experiment_of(ROOT / "experiments" / "quick.yaml", "steps=6")
    held = MeasurementTurn("a", tmp_path)
    held.acquire()
    try:
        one, two = ranks(1), ranks(2)
        one.submit(train_in_turns, trial_spec(experiment, Point("deepspeed", 0, 64, 1)), str(tmp_path), ["a"])
        two.submit(
            train_in_turns, trial_spec(experiment, Point("deepspeed", 1, 64, 2)), str(tmp_path), ["a", "b"]
        )
        # Go on once both ranks on "a" wait to set up (the kernel lists blocked flocks in /proc/locks).
        assert _wait_until(lambda: _waiting_on(tmp_path / "a.setup") == 2, 120)
    finally:
        released_at = time.time()
        held.release()
    single, pair = one.results(), two.results()
    on_a = [single[0], pair[0]]  # rank 1 of the pair is on device "b"
    assert all(r["set_up_from"] >= released_at for r in on_a)
    trials = sorted(
        (min(r["measuring_from"] for r in mine), max(r["measuring_until"] for r in mine))
        for mine in (single, pair)
    )
    assert trials[0][1] <= trials[1][0], trials  # one after the other
    for rank in on_a:  # no set-up on "a" while the other trial measures
        other = trials[1] if rank["measuring_from"] < trials[1][0] else trials[0]
        assert rank["set_up_until"] <= other[0] or rank["set_up_from"] >= other[1], (rank, other)
    assert pair[1]["turn_wait_s"] > 0  # rank 1 waits at its trial's barrier for rank 0's turn
    free = MeasurementTurn("a", tmp_path)
    free.acquire()
    assert free.waited_s < 1
    free.release()


def test_auto_trials_per_gpu_follow_the_hosts_cpus_and_memory():
    from ray_zero.run.gpu_sharing import trials_per_gpu

    assert trials_per_gpu(6, 16, 1, 128 * GIB) == 6  # a number is taken as given
    assert trials_per_gpu("auto", 16, 1, 128 * GIB) == 16  # the lent H200: 16 cores, 128 GiB
    assert trials_per_gpu("auto", 128, 8, 560 * GIB) == 16  # 8 x H200: 16 cores and 70 GiB a GPU
    assert trials_per_gpu("auto", 32, 1, 24 * GIB) == 6  # a workstation: memory bounds it
    assert trials_per_gpu("auto", 4, 8, None) == 1  # fewer cores than GPUs: still one a GPU
