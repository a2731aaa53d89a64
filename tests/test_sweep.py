"""End to end on CPU with real Ray, real DeepSpeed and real MNIST digits: the quick grid, and stages 2/3."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from ray_zero.config import load_experiment
from ray_zero.cpu_counters import ThreadCounters
from ray_zero.report import COLUMNS, load_trials
from ray_zero.sweep import run_sweep
from ray_zero.worker import jit_ops_dir

REQUIRED = ["stage", "micro_batch_size", "num_workers", "precision", "model", "params", "dataset", "steps",
            "status", "loss_first", "loss_last", "samples_per_s", "samples_per_s_per_worker",
            "peak_allocated_gib_max", "peak_reserved_gib_max", "optimizer_state_bytes_per_rank_max", "wall_s"]


@pytest.fixture(scope="module")
def quick_sweep(ray_instance, tmp_path_factory):
    output = tmp_path_factory.mktemp("quick")
    experiment = load_experiment("experiments/quick.yaml", ["steps=6", "warmup_steps=2",
                                                            f"data_dir={output / 'mnist'}"])
    frame = run_sweep(experiment, output, command="pytest quick")
    return output, frame


def test_quick_grid_gives_four_ok_rows(quick_sweep):
    output, frame = quick_sweep
    table = pd.read_csv(output / "results.csv")
    assert list(table.columns[:len(REQUIRED)]) == REQUIRED and set(COLUMNS) <= set(table.columns)
    assert len(table) == 4 and set(table["status"]) == {"ok"}
    assert sorted(zip(table["stage"], table["num_workers"])) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(math.isfinite(v) for v in table["loss_first"]) and all(math.isfinite(v) for v in table["loss_last"])
    assert (table["precision"] == "fp32").all() and (table["params"] == 274_698).all()
    assert (table["samples_per_s"] > 0).all() and (table["peak_allocated_gib_max"] > 0).all()
    assert (table["memory_kind"] == "cpu_rss").all()
    assert table["data_source"].str.contains("MNIST").all()
    # One at a time (the 2-worker trials fill both CPUs): Tune ran every trial in the same driver process.
    rows = load_trials(output)
    assert len({r["driver_pid"] for r in rows}) == 1
    # Ray Train's controller ran in that process (controller_in_trial_driver), not in one of its own.
    assert all(r["controller_pid"] == r["driver_pid"] for r in rows)
    assert all(r["queued_s"] > 0 and r["wall_s"] > r["timed_s"] for r in rows)


@pytest.mark.skipif("TORCH_EXTENSIONS_DIR" in os.environ, reason="the user chose the JIT build folder")
def test_ranks_build_deepspeeds_cpu_op_in_this_environments_own_folder(quick_sweep):
    # torch's default folder is shared by every venv of the machine, which then rebuild it in turn.
    output, _ = quick_sweep
    assert set(pd.read_csv(output / "per_rank.csv")["jit_ops_dir"]) == {jit_ops_dir()}
    build_file = Path(jit_ops_dir()) / "deepspeed_shm_comm" / "build.ninja"
    assert str(Path(torch.__file__).parent / "include") in build_file.read_text()


def test_zero1_halves_optimizer_state_per_rank_at_two_workers(quick_sweep):
    _, frame = quick_sweep
    state = {(r.stage, r.num_workers): r.optimizer_state_bytes_per_rank_max for r in frame.itertuples()}
    assert abs(state[(1, 2)] / state[(0, 2)] - 0.5) < 0.01
    assert abs(state[(1, 1)] / state[(0, 1)] - 1.0) < 0.01
    assert state[(0, 2)] == state[(0, 1)]  # stage 0 replicates: flat in N
    # 2 fp32 Adam states of 274,698 params: 2,197,584 bytes (plus step counters)
    assert 2 * 4 * 274_698 <= state[(0, 1)] < 2 * 4 * 274_698 * 1.01


def test_trials_stop_ray_trains_placement_group_cleaner_without_waiting_and_none_is_left(quick_sweep):
    import psutil
    from ray.train import ScalingConfig
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from ray_zero.train_run import StopCleanerWithoutWaiting, Trainer

    # The trainer a trial builds gives its controller the cleaner that is told to stop, not waited for...
    kinds = {type(c) for c in Trainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))
             ._create_default_callbacks()}
    assert StopCleanerWithoutWaiting in kinds and PlacementGroupCleanerCallback not in kinds
    # ...and every trial's cleaner (a detached actor, one per run) has still gone once the sweep is done.
    def cleaners():
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if "PlacementGroupCleaner" in " ".join(p.info["cmdline"] or [])]
    deadline = time.monotonic() + 10  # each notices the stop within its 1 s check
    while cleaners() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cleaners() == []


def test_per_rank_file_has_every_rank_and_memory_is_max_over_ranks(quick_sweep):
    output, frame = quick_sweep
    ranks = pd.read_csv(output / "per_rank.csv")
    assert len(ranks) == 1 + 2 + 1 + 2
    for row in frame.itertuples():
        mine = ranks[ranks["trial"] == row.trial]
        assert sorted(mine["rank"]) == list(range(row.num_workers))
        assert row.peak_allocated_gib_max == pytest.approx(mine["peak_allocated_gib"].max())
        assert row.peak_allocated_gib_min == pytest.approx(mine["peak_allocated_gib"].min())
        assert row.samples_per_s == pytest.approx(mine["samples_per_s"].sum())
        # One timed window of 5 steps here (steps 2-4 of 6): its rate, within 2x of the whole timed rate.
        assert (mine["window_samples_per_s_median"] == mine["window_samples_per_s_p90"]).all()
        assert row.window_samples_per_s_median == pytest.approx(mine["window_samples_per_s_median"].sum())
        assert 0.5 < row.window_samples_per_s_median / row.samples_per_s < 2
    # Ray starts its workers at niceness 15; the ranks train at worker_niceness (default 0), like torchrun's.
    assert (ranks["niceness"] == 0).all()
    # Every trial's ranks stay in the folder Ray started its workers in (here this session's), where
    # Ray Train would move each run to a new one (cuDNN's compiled kernels are reused only from one folder).
    assert set(ranks["working_dir"]) == {os.getcwd()}
    # The first step's marks, in order: forward, backward, optimizer step.
    assert ((ranks["initialized_at"] < ranks["first_forward_at"]) & (ranks["first_forward_at"] < ranks["first_backward_at"])
            & (ranks["first_backward_at"] < ranks["first_step_at"])).all()
    # Where the timed steps' time went: the training thread's CPU time and Python's collector, within it.
    assert ((ranks["timed_thread_cpu_s"] > 0) & (ranks["timed_thread_cpu_s"] <= ranks["timed_s"] * 1.05 + 0.01)).all()
    assert ((ranks["timed_thread_system_s"] >= 0) & (ranks["timed_thread_system_s"] <= ranks["timed_thread_cpu_s"] + 0.02)).all()
    assert (ranks["timed_minor_faults"] >= 0).all()
    assert ((ranks["timed_busiest_other_thread_cpu_s"] >= 0)
            & (ranks["timed_busiest_other_thread_cpu_s"] <= ranks["timed_other_threads_cpu_s"])).all()
    assert ((ranks["timed_gc_s"] >= 0) & (ranks["timed_gc_s"] < ranks["timed_s"])).all()
    # The timed steps' host time by phase: each part of it, together no more than all of it.
    phases = ranks[["timed_forward_s", "timed_backward_s", "timed_optimizer_step_s", "timed_other_s"]]
    assert (phases > 0).all().all() and (phases.sum(axis=1) <= ranks["timed_s"] + 1e-6).all()
    # The training thread's instructions where the machine counts them (hardware counters), else empty.
    counters = ThreadCounters.open()
    if counters is None:
        assert ranks["timed_thread_instructions"].isna().all()
    else:
        counters.close()
        assert (ranks["timed_thread_instructions"] > 0).all()
    # ... its time waiting for a core (Linux), and the times it blocked; on CPU a rank has 1 torch thread.
    assert ((ranks["timed_run_queue_s"] >= 0) & (ranks["timed_run_queue_s"] < ranks["timed_s"])).all()
    assert (ranks["timed_voluntary_switches"] >= 0).all() and (ranks["torch_threads"] == 1).all()
    # Each rank's main thread slept while it trained (ray_zero/main_thread.py).
    assert ranks["main_thread_held"].all()
    # DeepSpeed turns torch's NVML-based GPU check on; CPU ranks turn it off (it loads NVML at every step).
    assert not ranks["nvml_cuda_check"].any()


def test_results_markdown_provenance_and_plots(quick_sweep):
    output, _ = quick_sweep
    markdown = (output / "results.md").read_text()
    assert "peak resident set size" in markdown and markdown.count("| ok |") == 4
    provenance = (output / "experiment.yaml").read_text()
    for key in ("python:", "torch:", "deepspeed: 0.19.8", "ray: 2.60.0", "cpu:", "date:", "command: pytest quick"):
        assert key in provenance
    assert (output / "memory.png").stat().st_size > 1000 and (output / "throughput.png").stat().st_size > 1000


def test_report_rerenders_without_ray(quick_sweep, cli):
    output, _ = quick_sweep
    (output / "results.md").unlink()
    (output / "memory.png").unlink()
    done = cli("report", str(output))
    assert done.returncode == 0, done.stderr
    assert "stage1_mb64_w2" in done.stdout and (output / "results.md").is_file() and (output / "memory.png").is_file()


def test_stages_2_and_3_run_on_cpu_the_second_started_early(ray_instance, tmp_path):
    experiment = load_experiment("experiments/quick.yaml", [
        "steps=4", "warmup_steps=1", "dataset=synthetic", "grid.stage=[2,3]", "grid.num_workers=[2]",
        "overlap_startup=true", "worker_niceness=15", "controller_in_trial_driver=false"])
    frame = run_sweep(experiment, tmp_path, command="pytest stages 2 3")
    assert list(frame["status"]) == ["ok", "ok"] and list(frame["stage"]) == [2, 3]
    assert (pd.read_csv(tmp_path / "per_rank.csv")["niceness"] == 15).all()  # Ray's own default, asked for
    assert frame["loss_last"].map(math.isfinite).all()
    # Both trials' drivers and controllers started at once; one trained while the other waited for the CPUs.
    first, second = sorted(load_trials(tmp_path), key=lambda r: r["finished_at"])
    assert second["fit_started_at"] < first["finished_at"] < second["process_started_at"]
    assert second["queued_s"] > first["wall_s"] - 1
    # Ray Train's own controller actors, asked for: a process of their own for each trial.
    assert len({first["controller_pid"], second["controller_pid"], first["driver_pid"], second["driver_pid"]}) == 4


def _remove_coordinator(ray, name: dict) -> None:
    try:
        ray.kill(ray.get_actor(**name), no_restart=True)
    except ValueError:
        return
    for _ in range(100):  # a killed actor's name is released asynchronously
        try:
            ray.get_actor(**name)
        except ValueError:
            return
        time.sleep(0.1)
    pytest.fail("the killed coordinator kept its name")


def test_sweep_start_creates_the_coordinator_ray_train_waits_for(ray_instance, monkeypatch):
    """Cut 6 (bench/README.md): the sweep creates Ray Data's autoscaling coordinator itself, so the first
    trial's controller finds it instead of starting it and waiting."""
    from ray_zero.sweep import _start_autoscaling_coordinator

    ray = ray_instance
    name = {"name": "AutoscalingCoordinator", "namespace": "AutoscalingCoordinator"}
    _remove_coordinator(ray, name)  # earlier trials of this session created it: only the call below may now
    _start_autoscaling_coordinator()
    coordinator = ray.get_actor(**name)
    assert ray.get(coordinator.get_reserved_resources.remote("ray-zero-test"), timeout=60) == {}

    # A Ray without this private module: nothing is created, nothing raised.
    _remove_coordinator(ray, name)
    monkeypatch.setitem(sys.modules, "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator", None)
    _start_autoscaling_coordinator()
    with pytest.raises(ValueError):
        ray.get_actor(**name)


def test_trial_driver_and_train_controller_start_without_torch(tmp_path):
    """Cut 7 (bench/README.md): Tune's trial driver imports `ray_zero.trial`, Ray Train's controller
    unpickles the backend config and the callbacks; neither trains, so neither imports torch to start."""
    pickled = tmp_path / "controller_gets.pkl"
    driver = f"""
import sys, cloudpickle
import ray_zero.trial
from ray_zero.torch_backend import ImportTorchBackendEarly, LazyTorchConfig
config = LazyTorchConfig(backend="gloo")
# What DataParallelTrainer builds in the driver and sends to the controller (and the workers).
sent = (config, config.backend_cls(), config.train_func_context, ImportTorchBackendEarly())
open({str(pickled)!r}, "wb").write(cloudpickle.dumps(sent))
assert "torch" not in sys.modules, "the trial driver imported torch"
"""
    controller = f"""
import sys, cloudpickle
config, backend, context, early = cloudpickle.loads(open({str(pickled)!r}, "rb").read())
assert "torch" not in sys.modules, "unpickling the trial's config imported torch"
assert backend.share_cuda_visible_devices and config.to_dict()["backend"] == "gloo"
from ray.train.torch.config import TorchConfigContextManager, _TorchBackend  # what they stand for
assert _TorchBackend.share_cuda_visible_devices == backend.share_cuda_visible_devices
"""
    for code in (driver, controller):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
