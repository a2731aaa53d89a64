"""A rank's live figures reach the caller at most once a second, however often it measures a window
(one rank of the harness, real DeepSpeed, synthetic data: a window every step)."""

from __future__ import annotations

import time

from rank_group import train_rank, trial_spec

from ray_zero.config import Point
from ray_zero.experiment_file import validate_experiment


def train_recording_progress(rank: int, world_size: int, spec) -> dict:
    """The rank's training with an on_progress that records when each call came."""
    calls = []
    result = train_rank(
        rank,
        world_size,
        spec,
        on_progress=lambda step, values: calls.append([time.perf_counter(), step, values["samples_per_s"]]),
    )
    return {"calls": calls, "timed_s": result["timed_s"], "steps": result["steps"]}


def test_live_figures_come_at_most_once_a_second(ranks):
    experiment = validate_experiment(
        {
            "model": "seed",
            "dataset": "synthetic",
            "steps": 160,
            "warmup_steps": 10,
            "runtime": {"live_metrics_every": 1},
        }
    )
    out = ranks(1).call(train_recording_progress, trial_spec(experiment, Point("deepspeed", 1, 64, 1)))[0]
    calls = out["calls"]
    assert out["timed_s"] > 2.0, out  # long enough for several publishes at 1 a second
    assert 2 <= len(calls) <= out["timed_s"] + 1, (len(calls), out["timed_s"])  # not one per window (150)
    gaps = [b[0] - a[0] for a, b in zip(calls, calls[1:])]
    assert min(gaps) >= 1.0, gaps
    assert all(rate > 0 for _, _, rate in calls)
