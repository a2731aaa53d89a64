"""Nothing inside a rank's timed window but its steps (rank level): the model-state walk comes after it,
and the live gauges' publishing, which falls between timed steps, is not counted in it."""

from __future__ import annotations

import time

from rank_group import experiment_of, trial_spec

from ray_zero.config import Point

PUBLISH_S = 0.3


def train_watching_the_window(rank: int, world_size: int, spec) -> tuple[list, dict]:
    """train() with the timed window's start and stop, the model-state walks and the publishing logged."""
    import torch

    from ray_zero.measure.meter import Meter
    from ray_zero.train.engine_base import Engine
    from ray_zero.train.worker import train

    events: list[tuple[str, float]] = []
    start_timing, stop_timing, states = Meter.start_timing, Meter.stop_timing, Engine.model_state_bytes

    def start(self, step):
        start_timing(self, step)
        events.append(("start", time.perf_counter()))

    def stop(self, *args):
        events.append(("stop", time.perf_counter()))
        stop_timing(self, *args)

    def walk(self):
        events.append(("states", time.perf_counter()))
        return states(self)

    def publish(step, values):
        time.sleep(PUBLISH_S)  # a slow gauge export
        events.append(("publish", time.perf_counter()))

    Meter.start_timing, Meter.stop_timing, Engine.model_state_bytes = start, stop, walk
    try:
        result = train(spec, rank, world_size, torch.device("cpu"), on_progress=publish)
    finally:
        Meter.start_timing, Meter.stop_timing, Engine.model_state_bytes = start_timing, stop_timing, states
    return events, result


def test_the_timed_window_holds_the_steps_only(ranks):
    experiment = experiment_of(
        "experiments/quick.yaml", "steps=10", "warmup_steps=1", "runtime.live_metrics_every=1"
    )
    spec = trial_spec(experiment, Point("deepspeed", 1, 64, 1))
    events, result = ranks(1).call(train_watching_the_window, spec)[0]
    (started,), (stopped,) = ([t for e, t in events if e == kind] for kind in ("start", "stop"))
    walks = [t for e, t in events if e == "states"]
    published = [t for e, t in events if e == "publish"]
    assert walks and not any(started < t < stopped for t in walks)  # walked in warm-up and after
    assert published and all(started < t < stopped for t in published)
    # The publishing's sleep is not the steps' time.
    assert result["timed_s"] < (stopped - started) - PUBLISH_S * len(published) + 0.05
    assert result["timed_steps"] == 9
