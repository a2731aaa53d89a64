"""A point's timing (rank level, one rank): steps added until the timed window lasts timing_min_s and its
steps' spread is within timing_spread, capped by timing_max_steps, and the row marked where the bound was
not reached; and what cannot be known is blank with its reason (MFU on a CPU or an unknown GPU, TFLOP/s
of a model whose FLOPs were not counted)."""

from __future__ import annotations

import dataclasses

import pytest
from rank_group import experiment_of, trial_spec

from ray_zero.config import Point
from ray_zero.measure.meter import peak_tflops
from ray_zero.train.step_clock import median_and_spread

POINT = Point("deepspeed", 0, 16, 1)


def timed(ranks, *overrides: str) -> dict:
    experiment = experiment_of(
        "experiments/quick.yaml", "steps=6", "warmup_steps=1", "dataset=synthetic", *overrides
    )
    return ranks(1).train(trial_spec(experiment, POINT))[0]


def test_steps_are_added_until_the_window_lasts_its_minimum(ranks):
    plain = timed(ranks, "timing_min_s=0", "timing_spread=null")
    assert plain["timed_steps"] == 5 and plain["steps"] == 6 and plain["timing_unstable"] is False
    longer = timed(ranks, "timing_min_s=1.5", "timing_spread=null", "timing_max_steps=100000")
    assert longer["timed_steps"] > 5 and longer["steps"] == longer["timed_steps"] + 1
    assert longer["timing_unstable"] is False
    # The window lasts the minimum, checked at each window's end (runtime.live_metrics_every = 5 steps).
    assert longer["timed_s"] >= 1.5
    assert (longer["timed_steps"] - 5) * longer["step_median_s"] < 1.5 + 10 * longer["step_median_s"]


def test_the_budget_caps_the_steps_and_the_row_says_the_bound_was_not_reached(ranks):
    capped = timed(ranks, "timing_min_s=100000", "timing_max_steps=12")
    assert capped["timed_steps"] == 12 and capped["timing_unstable"] is True
    # Without a budget no step is added: the experiment's own are timed, and the mark says why not enough.
    unmarked = timed(ranks, "timing_min_s=100000")
    assert unmarked["timed_steps"] == 5 and unmarked["timing_unstable"] is True
    # A spread no timing meets: marked too.
    tight = timed(ranks, "timing_min_s=0", "timing_spread=0.000001")
    assert tight["timing_unstable"] is True and tight["step_spread"] > 1e-6
    for report in (capped, unmarked, tight):
        assert report["step_median_s"] > 0 and report["counted_steps"] > 0


def test_median_and_spread_are_the_quartiles_of_the_steps():
    assert median_and_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, (4.0 - 2.0) / 3.0)
    assert median_and_spread([0.5]) == (0.5, None)  # one step has no spread: never within a bound


def test_mfu_is_blank_with_its_reason_on_cpu_and_tflops_too_where_flops_were_not_counted(ranks):
    experiment = experiment_of("experiments/quick.yaml", "steps=3", "warmup_steps=1", "dataset=synthetic")
    spec = trial_spec(experiment, POINT)
    counted = ranks(1).train(spec)[0]
    assert counted["tflops"] > 0 and counted["mfu"] is None
    assert counted["mfu_blank"] == "a CPU rank: no peak FLOP/s to divide by"
    # A model the meta device could not count (flops_and_saved's note, ray_zero/models/counting.py).
    note = (
        "; parameters counted on meta, FLOPs and activations not counted (aten::_unique2 has no meta kernel)"
    )
    uncounted = dataclasses.replace(
        spec,
        model=dataclasses.replace(
            spec.model, flops_per_sample=0.0, description=spec.model.description + note
        ),
    )
    report = ranks(1).train(uncounted)[0]
    assert report["tflops"] is None and report["mfu"] is None and report["samples_per_s"] > 0
    assert report["mfu_blank"] == "FLOPs not counted (aten::_unique2 has no meta kernel)"


@pytest.mark.parametrize(
    "name, precision, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),  # SXM
        ("NVIDIA H100 PCIe", "bf16", 756.0),  # not the SXM's peak, as a substring match gave it
        ("NVIDIA H100 NVL", "fp16", 835.0),
        ("NVIDIA H200", "fp16", 989.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16", None),  # a slice: no peak of its own here
        ("Tesla T4", "bf16", None),  # no bf16 tensor cores
        ("NVIDIA RTX 9999", "fp16", None),
    ],
)
def test_a_gpus_peak_is_found_by_its_exact_name(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_the_auto_bound_counts_every_step_the_trial_may_run():
    """runtime.trial_timeout_s auto: four times the steps at a pessimistic rate, the added timed steps
    (timing_max_steps) and the counted steps after the window included; never under the floor."""
    from ray_zero.run.watchdog import BOUND_FACTOR, BOUND_FLOOR_S, PESSIMISTIC_FLOPS, trial_bound_s
    from ray_zero.train.steps import COUNTED_STEPS

    def bound(*overrides: str) -> float:
        spec = trial_spec(experiment_of("experiments/quick.yaml", *overrides), POINT)
        samples = POINT.micro_batch_size * spec.model.flops_per_sample
        return trial_bound_s(spec), BOUND_FACTOR * samples / PESSIMISTIC_FLOPS["cpu"]

    plain, per_step = bound("steps=6", "warmup_steps=1", "runtime.trial_timeout_s=auto")
    assert plain == BOUND_FLOOR_S  # the quick model's steps are far under the floor
    steps = int(BOUND_FLOOR_S / per_step)  # past the floor: the bound is the steps' own
    long, _ = bound(f"steps={steps}", "warmup_steps=1", "runtime.trial_timeout_s=auto")
    assert long == pytest.approx((steps + COUNTED_STEPS) * per_step)
    budget, _ = bound(f"steps={steps}", "warmup_steps=1", f"timing_max_steps={2 * steps}")
    assert budget == pytest.approx((1 + 2 * steps + COUNTED_STEPS) * per_step)
    assert bound("runtime.trial_timeout_s=42")[0] == 42
