"""bench/: a real bare-DeepSpeed run under torchrun (bench/bare_and_ray.py, bench/bare_deepspeed.py,
ray_zero.train.worker.train), its phases adding up to its wall time, compare_overhead.py over an old- and
a new-format bench.csv, sweep_bench.py's summary of its committed records, and speed_split.py's split and
speed_accuracy.py's prediction of a committed CPU row from a profile measured here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bare_and_ray  # noqa: E402

from ray_zero.experiment_file import load_experiment  # noqa: E402


def test_phases_count_a_mark_earlier_than_the_last_from_the_last():
    # A worker process Ray started before fit() (a prestarted one): the trial waited from fit(), not before.
    marks = {
        "began_at": 10.0,
        "fit_started_at": 11.0,
        "process_started_at": 5.0,
        "train_loop_started_at": 14.0,
    }
    got = bare_and_ray.phases(marks, bare_and_ray.RAY_PHASES[:3], "ray")
    assert list(got.values()) == [1.0, 0.0, 3.0]
    assert sum(got.values()) == marks["train_loop_started_at"] - marks["began_at"]


def test_bare_run_measures_the_trial_and_its_phases_add_up(tmp_path):
    experiment = load_experiment(
        ROOT / "experiments" / "quick.yaml",
        ["steps=4", "warmup_steps=1", "grid.stage=[1]", "grid.num_workers=[1]"],
    ).with_absolute_paths()
    plan, model = bare_and_ray.plan_and_model(experiment)
    spec = bare_and_ray.bare_spec(experiment, plan.runnable[0], plan, model, tmp_path)
    row = bare_and_ray.run_bare(spec, tmp_path)
    assert (
        row["trial"] == "stage1_mb64_w1" and row["samples_per_s"] > 0 and 0 < row["timed_s"] < row["wall_s"]
    )
    marks = row["marks"]
    assert (
        marks["launched_at"]
        < marks["process_started_at"]
        < marks["train_loop_started_at"]
        < marks["model_build_at"]
    )
    assert marks["initialize_at"] < marks["warmed_up_at"] < marks["finished_at"] < marks["exited_at"]
    phases = {k: v for k, v in row.items() if k.startswith("bare ")}
    assert len(phases) == len(bare_and_ray.BARE_PHASES) and min(phases.values()) >= 0
    assert abs(sum(phases.values()) - row["wall_s"]) < 1e-6


def test_compare_overhead_reads_old_and_new_bench_csv(tmp_path):
    def write(name: str, overheads: list[float], with_workers: bool) -> Path:
        frame = pd.DataFrame(
            {
                "trial": ["stage0_mb64_w2", "stage1_mb64_w2"],
                "order_in_sweep": [1, 2],
                "ray_zero_overhead_s": overheads,
                "overhead_minus_bare_s": [o - 4 for o in overheads],
                "samples_per_s_ratio": [0.9, 0.95],
            }
        )
        if with_workers:
            frame.insert(1, "num_workers", 2)
        frame.to_csv(tmp_path / name, index=False)
        return tmp_path / name

    old = [write("old1.csv", [20.0, 10.0], False), write("old2.csv", [20.0, 12.0], False)]
    new = [write("new1.csv", [30.0, 15.0], True)]
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "compare_overhead.py"),
            "--old",
            *map(str, old),
            "--new",
            *map(str, new),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    text = done.stdout
    assert "old 2 from 2 runs, new 1 from 1 runs" in text and "2 workers: stage1_mb64_w2" in text
    # Only the second trials count: old 10 and 12 (median 11), new 15: new - old = +4.
    assert "new - old  +4.000  (difference of the medians)" in text


def test_sweep_bench_judges_the_grid_and_reads_the_gpu_log_of_its_records():
    # bench/results/sweep-h200-gpt2-serial: 2 pairs, nvidia-smi sampled through both (--gpu-log).
    import gpu_log
    import sweep_bench

    records = ROOT / "bench" / "results" / "sweep-h200-gpt2-serial"
    runs = {side: sorted(records.glob(f"{side}-*/")) for side in ("old", "new")}
    points = sweep_bench.compare(runs).set_index("trial")
    # Its two one-at-a-time runs measured 56.3 and 48.3 samples/s there (per_rank.csv).
    assert abs(points.loc["stage0_mb4_w1", "spread_old"] - 56.3 / 48.3) < 0.01
    gpu = gpu_log.timed_window(runs, gpu_log.read(records)).set_index("trial")
    assert len(gpu) == 9 and not any(name.endswith("_calibration") for name in gpu.index)
    assert gpu["sm_mhz_min_old"].between(1000, 2100).all() and gpu["util_pct_new"].between(1, 100).all()
    text = sweep_bench.summary(records, "pytest", "strictly one at a time")
    assert "7 of 9 within 10 %" in text
    assert "old: runtime.overlap_startup=false runtime.share_gpus=false" in text


def test_sweep_bench_timeline_splits_a_gpu_sweep_into_set_up_measuring_and_idle():
    # bench/results/sweep-h100-gpt2-24-waves: 24 trials on one H100, before (old) and after (new) trials
    # that come while others wait for their turn set up together; 52.8 and 20.6 s idle between turns
    # (each run's trials.jsonl, by hand).
    import turn_marks

    from ray_zero.store import load_trials

    records = ROOT / "bench" / "results" / "sweep-h100-gpt2-24-waves"
    runs = {side: sorted(records.glob(f"{side}-*/")) for side in ("old", "new")}
    timeline = turn_marks.turn_timeline(runs).set_index("run")
    assert (timeline["trials"] == 24).all()
    idle = timeline["between_turns_s"]
    assert idle["old-1"] == 52.8 and idle["new-1"] == 20.6
    parts = timeline[["to_first_turn_s", "measuring_s", "between_turns_s"]].sum(axis=1)
    assert ((parts - timeline["span_s"]).abs() <= 0.2).all()  # windows never overlap: the parts add up
    cpu = ROOT / "bench" / "results" / "sweep-cpu-quick" / "new-1"  # CPU trials take no turns
    assert len(load_trials(cpu)) and turn_marks.turn_timeline({"old": [], "new": [cpu]}).empty


def test_speed_split_is_the_committed_one_and_a_committed_cpu_row_is_predicted_from_a_cpu_profile(tmp_path):
    """bench/speed_split.py's seeded rule gives the split it committed (disjoint sides); speed_accuracy.py
    predicts a committed one-worker CPU row's samples/s from a profile that the profile command's function
    measured here at a budget of 0.3 s."""
    import speed_accuracy
    import speed_split

    import ray_zero

    # The seeded rule over the committed families gives the committed sides (rows committed later with
    # new families stay outside the split: they never move a family from one side to the other).
    committed = speed_split.load_split()
    families = committed["tuning"] + committed["held_out"]
    again = speed_split.split(families, committed["seed"])
    assert (again["tuning"], again["held_out"]) == (committed["tuning"], committed["held_out"])
    assert not set(committed["tuning"]) & set(committed["held_out"])
    assert round(len(committed["held_out"]) / len(families), 1) == 0.3
    assert speed_split.side_of("hf:a_family_committed_later", committed) == "outside"

    path = ray_zero.profile(tmp_path / "cpu.json", device="cpu", budget_s=0.3)
    profile = speed_accuracy.read_profile(path)
    rows = [
        {**r, "profile": "cpu"}
        for r in speed_split.committed_rows("cpu_rss")
        if r["folder"] == "bench/results/cpu-2core/ray_zero/w1"
    ]
    assert rows and {r["family"] for r in rows} == {"seed"}
    predicted = speed_accuracy.predict_rows(rows, {"cpu": profile}, speed_accuracy.Traces())
    for r in predicted:
        assert "reason" not in r, r.get("reason")
        assert r["predicted"]["predicted_samples_per_s"] > 0
        assert r["predicted"]["bound"] in ("compute", "memory", "host")
        assert r["ratio"] == r["row"]["samples_per_s"] / r["predicted"]["predicted_samples_per_s"]
    # The cross-GPU case's scaling: a profile carried to itself is itself.
    same = speed_accuracy.scaled_profile(profile, profile)
    assert same.curves == profile.curves and same.launch_s == profile.launch_s
