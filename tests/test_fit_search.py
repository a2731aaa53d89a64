"""fit's search logic with no trials: `BracketSearch` driven by peaks from tables, its answer checked
against an exhaustive scan of the same table, and the first guess against the memory model.

The tables: one measured on this 2-core CPU machine (MEASURED, below: every micro-batch of an exhaustive
sweep), and families of peaks the search must handle (linear, convex, flat then steep, out of memory
above a size, noisy). fit end to end through Ray Tune: tests/test_fit.py.
"""

from __future__ import annotations

import math
import random

import pytest

from ray_zero.measure import error_band
from ray_zero.measure.memory_model import predict_point
from ray_zero.measure.prediction import GIB
from ray_zero.measure.search import BracketSearch, Steps, largest_predicted_to_fit

# Peak resident set per worker (GiB) of `experiments/fit_gpt2_cpu.yaml` (tiny GPT-2, seq_len 512), DeepSpeed
# stages 0 and 1, one worker, at every micro-batch from 16 to 192 in steps of 16: an exhaustive sweep of 24
# trials, 2 at a time, on the 2-core CPU machine (AMD EPYC, Python 3.11.7, torch 2.14.1, DeepSpeed 0.19.8,
# Ray 2.60.0), 2026-12-03, from a checkout of commit 507be71: `python -m ray_zero sweep
# experiments/fit_gpt2_cpu.yaml --set 'grid.micro_batch_size=[16,32,48,64,80,96,112,128,144,160,176,192]'
# --set 'grid.stage=[0,1]' --output OUT` (OUT/results.csv, peak_allocated_gib_max). The resident set is not
# monotone in the micro-batch: at stage 1, 48 samples peaked above 64 (glibc's heap, not the tensors).
MEASURED: dict[int, dict[int, float]] = {
    0: {
        16: 1.312,
        32: 1.499,
        48: 1.763,
        64: 1.802,
        80: 2.031,
        96: 2.241,
        112: 2.488,
        128: 2.679,
        144: 2.899,
        160: 3.157,
        176: 3.359,
        192: 3.626,
    },
    1: {
        16: 1.293,
        32: 1.577,
        48: 1.85,
        64: 1.84,
        80: 2.057,
        96: 2.298,
        112: 2.506,
        128: 2.725,
        144: 2.926,
        160: 3.164,
        176: 3.404,
        192: 3.672,
    },
}


def exhaustive_answer(peaks: dict[int, float | None], budget: float) -> int | None:
    """The largest micro-batch of the table that fits (None: an out-of-memory entry)."""
    fitting = [m for m, peak in peaks.items() if peak is not None and peak <= budget]
    return max(fitting) if fitting else None


def search(
    peaks: dict[int, float | None],
    budget: float,
    steps: Steps,
    first_guess: int | None = None,
    fail_at: int | None = None,
    per_sample: float | None = None,
) -> BracketSearch:
    """Run a search to its end, each probe answered from the table (None there: out of memory), with the
    activations per sample a probe measures where given."""
    found = BracketSearch(budget, steps, first_guess)
    for _ in range(50):
        micro = found.next_probe()
        if micro is None:
            return found
        assert micro in peaks, f"the search asked for {micro}, not a size the steps allow ({sorted(peaks)})"
        if micro == fail_at:
            found.record(micro, "failed", None, error="RuntimeError: injected")
        elif peaks[micro] is None:
            found.record(micro, "oom", None)
        else:
            found.record(micro, "ok", peaks[micro], per_sample)
    raise AssertionError(f"no end after 50 probes: {found.probes}")


def out_of_order(peaks: dict[int, float | None], budget: float) -> bool:
    """Some micro-batch is over the budget while a larger one is within it."""
    sizes = sorted(m for m, peak in peaks.items() if peak is not None)
    return any(peaks[a] > budget >= peaks[b] for i, a in enumerate(sizes) for b in sizes[i + 1 :])


def budgets_between(peaks: dict[int, float | None]) -> list[float]:
    """A budget midway between every two neighbouring measured peaks, and below and above all of them."""
    values = sorted(p for p in peaks.values() if p is not None)
    return [values[0] * 0.9, *((a + b) / 2 for a, b in zip(values, values[1:]) if b > a), values[-1] * 1.1]


def tables() -> dict[str, dict[int, float | None]]:
    sizes = range(16, 16 * 13, 16)
    noise = random.Random(0)
    return {
        "linear": {m: 1.2 + 0.01 * m for m in sizes},
        "convex": {m: 1.0 + 0.00005 * m * m for m in sizes},
        "flat then steep": {m: 1.5 if m <= 96 else 1.5 + 0.05 * (m - 96) for m in sizes},
        "out of memory from 144": {m: (2.0 + 0.02 * m if m < 144 else None) for m in sizes},
        "noisy": {m: 1.3 + 0.008 * m + noise.uniform(-0.004, 0.004) for m in sizes},
        **{f"measured, stage {stage}": peaks for stage, peaks in MEASURED.items()},
    }


@pytest.mark.parametrize("name", tables())
def test_the_search_finds_the_exhaustive_answer_in_few_probes(name):
    peaks = tables()[name]
    steps = Steps(granularity=16, largest=max(peaks))
    for budget in budgets_between(peaks):
        found = search(peaks, budget, steps)
        expected = exhaustive_answer(peaks, budget)
        if out_of_order(peaks, budget):
            # A smaller micro-batch over the budget, a larger one within it (the measured tables, at one
            # budget each): no search short of every size can know; the answer fits, the next size did not.
            expected = found.answer
            assert expected is not None and peaks[expected] <= budget, (name, budget, found.probes)
        assert found.answer == expected, (name, budget, found.probes)
        # Two probes for a first slope, doubling up to a bracket, then the line or halving inside it.
        assert found.stopped is None and len(found.probes) <= math.ceil(math.log2(len(peaks))) + 3, (
            name,
            budget,
        )
        if expected is not None and expected < max(peaks):  # the answer is bracketed by what was measured
            above = [p for p in found.probes if p.micro_batch_size == expected + 16]
            assert above and not above[0].fits, (name, budget, found.probes)


def test_a_good_first_guess_saves_probes():
    peaks = tables()["linear"]
    steps = Steps(granularity=16, largest=max(peaks))
    budget = (peaks[112] + peaks[128]) / 2
    blind, guided = search(peaks, budget, steps), search(peaks, budget, steps, first_guess=112)
    assert blind.answer == guided.answer == 112 and guided.probes[0].micro_batch_size == 112
    assert len(guided.probes) < len(blind.probes)
    # With the activations per sample a probe measures (0.01 GiB here), 112 fits and 128 does not: done.
    measured = search(peaks, budget, steps, first_guess=112, per_sample=0.01)
    assert measured.answer == 112 and [p.micro_batch_size for p in measured.probes] == [112, 128]


def test_a_failing_probe_ends_its_search_without_an_answer():
    peaks = tables()["linear"]
    steps = Steps(granularity=16, largest=max(peaks))
    found = search(peaks, (peaks[64] + peaks[80]) / 2, steps, fail_at=32)
    assert found.stopped == "micro-batch 32: failed: RuntimeError: injected"
    assert found.next_probe() is None and all(p.micro_batch_size != 32 for p in found.probes)
    assert found.answer in (None, 16)


def test_nothing_fits_the_smallest():
    peaks = tables()["linear"]
    found = search(peaks, peaks[16] / 2, Steps(granularity=16, largest=max(peaks)))
    assert found.answer is None and [p.micro_batch_size for p in found.probes] == [16]


def test_steps_without_granularity_are_every_size_below_64_then_multiples_of_8():
    steps = Steps()
    assert [steps.down(v) for v in (0, 1, 63.9, 64, 71, 72, 1000)] == [1, 1, 63, 64, 64, 72, 1000]
    assert [steps.up(v) for v in (1, 63, 64, 72)] == [2, 64, 72, 80]
    assert Steps(granularity=32).down(95) == 64 and Steps(granularity=32).down(3) == 32


def _gpu_row(micro: int) -> dict:
    """A results row of the 806 M preset on one GPU, fp16, DeepSpeed stage 1 (the memory model predicts
    its activations from the preset's shapes)."""
    return {
        "backend": "deepspeed",
        "stage": 1,
        "micro_batch_size": micro,
        "num_workers": 1,
        "precision": "fp16",
        "model": "large",
        "params": 805_888_010,
        "memory_kind": "cuda",
        "dataset": "mnist",
    }


@pytest.mark.parametrize("budget", [17.0, 24.0, 40.0, 80.0])
def test_the_first_guess_is_the_largest_size_the_memory_model_fits(budget):
    def predicted(micro: int) -> float:
        return predict_point(_gpu_row(micro)).peak_bytes / GIB

    for steps in (Steps(largest=2048), Steps(granularity=32, largest=4096), Steps(largest=100)):
        guess = largest_predicted_to_fit(predicted, budget, steps)
        allowed = [m for m in range(1, steps.largest + 1) if steps.down(m) == m]
        expected = max((m for m in allowed if predicted(m) <= budget), default=steps.smallest)
        assert guess == expected, (budget, steps, guess, expected)


def test_no_first_guess_where_the_model_cannot_predict():
    assert largest_predicted_to_fit(lambda micro: None, 10.0, Steps()) is None
    assert (
        largest_predicted_to_fit(lambda micro: 20.0, 10.0, Steps(granularity=8)) == 8
    )  # over even at the smallest


def test_a_prediction_the_first_probe_confirms_ends_the_search_there():
    # The traced prediction puts the answer at 96 of steps of 16 (linear peaks, measured as predicted):
    # the first probe fits, the next size up is predicted 7 % over the budget: one probe, the answer.
    steps = Steps(16, 192)
    peaks = {m: 1.2 + 0.01 * m for m in range(16, 208, 16)}
    budget = 2.2
    found = BracketSearch(budget, steps, 96, predicted=peaks.get)
    assert found.next_probe() == 96
    found.record(96, "ok", peaks[96])
    assert found.next_probe() is None and found.answer == 96 == exhaustive_answer(peaks, budget)
    # The next size predicted within 5 % of the budget: measured before the answer stands.
    near = BracketSearch(2.35, steps, 96, predicted=peaks.get)
    near.record(96, "ok", peaks[96])
    assert near.next_probe() == 112
    near.record(112, "ok", peaks[112])
    assert near.next_probe() is not None  # it fit: the search reaches on as before
    # A first probe that missed its prediction by more than 5 %: the usual search, not a confirmation.
    missed = BracketSearch(budget, steps, 96, predicted={m: p * 0.9 for m, p in peaks.items()}.get)
    missed.record(96, "ok", peaks[96])
    assert missed.next_probe() == 192  # no slope measured yet: it reaches for twice the size, as before


def test_searches_that_share_their_workers_share_a_run_unless_there_is_room_for_more():
    from conftest import ROOT
    from rank_group import experiment_of, trial_spec

    from ray_zero.config import Point
    from ray_zero.run.fit import in_runs
    from ray_zero.train.search_spec import SearchSpec

    experiment = experiment_of(ROOT / "experiments" / "fit_gpt2_cpu.yaml")
    points = [
        Point("deepspeed", 0, 1, 1),
        Point("deepspeed", 1, 1, 1),
        Point("deepspeed", 2, 1, 2),
        Point("fsdp", 3, 1, 1),
        Point("deepspeed", 3, 1, 1),
    ]
    searches = [SearchSpec(trial_spec(experiment, p), 1.0, Steps(1, 8)) for p in points]

    def names(drivers: int) -> list[list[str]]:
        return [[s.name for s in run] for run in in_runs(searches, drivers)]

    # One run at a time (one GPU): one run per engine and worker count, the searches in their order.
    assert names(1) == [["stage0_w1", "stage1_w1", "stage3_w1"], ["stage2_w2"], ["fsdp_stage3_w1"]]
    # Room for more runs at once: the largest group is split until there is a run for each.
    assert names(4) == [["stage0_w1"], ["stage1_w1", "stage3_w1"], ["stage2_w2"], ["fsdp_stage3_w1"]]
    assert sorted(map(len, names(8))) == [1] * 5


def _seq_len_search(budget: float, **fields):
    """A seq_len search of fit_gpt2_cpu.yaml's tiny GPT-2 (512 positions) at micro-batch 16, as on a GPU."""
    import dataclasses

    from conftest import ROOT
    from rank_group import experiment_of, trial_spec

    from ray_zero.config import Point
    from ray_zero.measure.search import FitSettings
    from ray_zero.train.search_spec import SearchSpec

    experiment = experiment_of(ROOT / "experiments" / "fit_gpt2_cpu.yaml", "precision=bf16").probe(3)
    steps = FitSettings(target="seq_len").steps([16], max_positions=512)
    spec = dataclasses.replace(trial_spec(experiment, Point("deepspeed", 1, 16, 1, seq_len=64)), use_gpu=True)
    return SearchSpec(spec, budget, steps, target="seq_len", **fields), steps


def test_a_seq_len_searchs_first_guess_is_predicted_from_a_step_traced_at_each_length():
    from ray_zero.run.fit import predicted_lengths

    search, steps = _seq_len_search(1.0)
    assert (steps.smallest, steps.largest, steps.up(128)) == (64, 512, 192)  # 64 tokens a step, to positions
    everywhere = dict(predicted_lengths(search.spec, 100.0, steps))
    assert list(everywhere) == [64, 128, 256, 512]  # doubling to the largest: every length fits
    peaks = list(everywhere.values())
    assert peaks == sorted(set(peaks))  # each length its own traced step: the peak grows with it
    # A budget between the peaks at 256 and 512: bisection finds the longest length predicted within it.
    budget = (everywhere[256] + everywhere[512]) / 2
    peaks = dict(predicted_lengths(search.spec, budget, steps))
    band = error_band.band_for("Transformers text")  # the guess honours the band's upper end
    guess = steps.down(max(n for n, peak in peaks.items() if band.high_gib(peak) <= budget))
    assert 256 <= guess < 512 and steps.up(guess) in peaks and band.high_gib(peaks[steps.up(guess)]) > budget
    # The search starts there, and a first probe measured as predicted is confirmed as micro-batches are.
    search, _ = _seq_len_search(budget, predicted_peaks=tuple(peaks.items()))
    found = search.search()
    assert found.first_guess == guess == found.next_probe()
    found.record(guess, "ok", peaks[guess])
    confirm = peaks[steps.up(guess)] <= budget * 1.05  # the next length predicted within 5 % of the budget
    assert found.next_probe() == (steps.up(guess) if confirm else None)
    assert search.at(guess).point.seq_len == guess and search.name == "stage1_mb16_w1"


def test_the_first_guess_is_where_the_bands_upper_end_fits_not_the_bare_prediction():
    # Issue 65: a budget that holds the predicted peak at 256 tokens but not its band's upper end.
    from ray_zero.run.fit import predicted_lengths

    search, steps = _seq_len_search(100.0)
    peak = dict(predicted_lengths(search.spec, 100.0, steps))[256]
    band = error_band.band_for("Transformers text")
    budget = (peak + band.high_gib(peak)) / 2
    search, _ = _seq_len_search(budget, predicted_peaks=predicted_lengths(search.spec, budget, steps))
    assert band.upper > 0 and search.first_guess() < 256


def test_fit_refuses_a_seq_len_target_it_cannot_search_in_one_line():
    from ray_zero.config import ConfigError
    from ray_zero.measure.search import FitSettings

    settings = FitSettings(budget_gib=2.0, target="seq_len")
    with pytest.raises(ConfigError, match="needs a token model"):
        settings.check_model(None, None)
    with pytest.raises(ConfigError, match=r"give no grid.seq_len \(\[128, 256\]\)"):
        settings.check_model(512, [128, 256])
    FitSettings(budget_gib=2.0).check_model(None, [128, 256])  # micro_batch: a search at each length
