"""Issue 65 item 4: a run corrects itself. A trial measured above its band hands what it measured beyond
its prediction to the later trials of its engine: their GPU share (made again in the same room) and fit's
first guess. Rows of the committed H100 population (bench/results/population-h100) are the misses."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest
from conftest import ROOT

from ray_zero.measure import correction, error_band
from ray_zero.measure.correction import Corrections
from ray_zero.measure.prediction import GIB
from ray_zero.rows import finish_row
from ray_zero.run.gpu_sharing import (
    ALONE_ABOVE,
    CONTEXT_BYTES,
    RESERVED_FACTOR,
    Need,
    gpu_shares,
)

POPULATION_ROWS = ROOT / "bench" / "results" / "population-h100" / "rows.jsonl.gz"
BAND_FIELDS = ("inside_band", "predicted_band", "band_class", "predicted_peak_high_gib")


def _population_rows() -> list[dict]:
    """The H100 population's ok rows, their bands judged again by this version's error_bands.json."""
    rows = [json.loads(line) for line in gzip.open(POPULATION_ROWS, "rt")]
    return [
        finish_row({k: v for k, v in r.items() if k not in BAND_FIELDS}) for r in rows if r["status"] == "ok"
    ]


def test_a_miss_above_the_band_gives_the_excess_that_reproduces_its_own_measured_peak():
    rows = _population_rows()
    misses = [(row, correction.from_row(row)) for row in rows]
    misses = [(row, found) for row, found in misses if found is not None]
    assert len(misses) >= 10  # the population's vision rows above their band
    for row, found in misses:
        assert row["inside_band"] is False and row["measured_over_predicted"] > 1
        assert found.engine == (row["backend"], row["activation_checkpointing"])
        assert found.peak_gib(row["predicted_peak_gib"]) == pytest.approx(
            row["peak_allocated_gib_max"], rel=1e-9
        )
    # Inside the band, or below it (over-predicted: the safe side), nothing is corrected.
    for row in rows:
        if row.get("inside_band") is not False or row["measured_over_predicted"] <= 1:
            assert correction.from_row(row) is None


def test_the_largest_miss_of_an_engine_holds_and_other_engines_are_left_alone():
    made = dict(status="ok", memory_kind="cuda", model="timm:resnet18", band_class="timm vision",
                device_name="NVIDIA H100 80GB HBM3", predicted_peak_gib=10.0,
                predicted_activation_gib=4.0)  # fmt: skip
    band = error_band.band_for("timm vision", "NVIDIA H100 80GB HBM3")
    found = Corrections()
    for trial, over in (("stage1_mb8_w1", 1.0), ("stage1_mb16_w1", 2.0), ("stage2_mb16_w1", 1.5)):
        peak = 10.0 * (1 + band.upper) + over
        found.add_row(
            finish_row({**made, "trial": trial, "backend": "deepspeed", "peak_allocated_gib_max": peak})
        )
    held = found.for_row({"backend": "deepspeed", "activation_checkpointing": False})
    assert held.trial == "stage1_mb16_w1" and held.excess_gib == pytest.approx(10.0 * band.upper + 2.0)
    assert found.for_row({"backend": "deepspeed", "activation_checkpointing": True}) is None
    assert found.for_row({"backend": "fsdp", "activation_checkpointing": False}) is None
    later = {"backend": "deepspeed", "activation_checkpointing": False, "predicted_peak_gib": 20.0,
             "predicted_activation_gib": 12.0}  # fmt: skip
    fields = correction.corrected_fields(later, held)
    assert fields["corrected_peak_gib"] == pytest.approx(20.0 + held.excess_gib)
    assert fields["corrected_from"].startswith("stage1_mb16_w1 measured ")
    assert correction.corrected_fields({**later, "backend": "fsdp"}, held) == {}


def _covered(needs: dict[str, Need], shares: dict[str, float], room, at_peak: str) -> bool:
    """What the shares reserve (of the room left once the largest step is set aside) and that step cover
    the others resident and `at_peak` at its peak: so they fit whenever the shares on a GPU sum to <= 1."""
    resident = sum(
        RESERVED_FACTOR * n.resident + CONTEXT_BYTES for name, n in needs.items() if name != at_peak
    )
    peak = RESERVED_FACTOR * needs[at_peak].peak + CONTEXT_BYTES
    return sum(shares.values()) * room.left + room.step >= resident + peak


def test_a_corrected_trial_reserves_the_step_beyond_the_one_set_aside():
    needs = {
        "a": Need(6 * GIB, 14 * GIB, "traced"),  # the largest step: 8 GiB above its resident
        "b": Need(4 * GIB, 9 * GIB, "traced"),
        "c": Need(5 * GIB, 10 * GIB, "traced"),
    }
    sharing = gpu_shares(needs, dict.fromkeys(needs, 1), 80 * GIB, 1, 100)  # no floor to hide it
    room = sharing.room
    assert all(_covered(needs, sharing.shares, room, name) for name in needs)
    # b measured 5 GiB over its prediction: its step (10 GiB) is now beyond a's 8 GiB set aside.
    corrected = {**needs, "b": dataclasses.replace(needs["b"], peak=needs["b"].peak + 5 * GIB)}
    assert not _covered(corrected, sharing.shares, room, "b")  # the old share no longer covers it
    share = room.share(corrected["b"], 1)
    after = {**sharing.shares, "b": share}
    assert share > sharing.shares["b"] and all(_covered(corrected, after, room, name) for name in needs)
    # Near the GPU's memory a corrected trial runs alone.
    assert room.share(dataclasses.replace(needs["b"], peak=ALONE_ABOVE * room.usable), 1) == 1.0


def test_fits_first_guess_takes_its_engines_measured_term_where_it_is_above_the_band():
    from rank_group import experiment_of, trial_spec

    from ray_zero.config import Point
    from ray_zero.measure.search import Steps
    from ray_zero.train.search_spec import SearchSpec

    # The 806 M preset on one GPU, fp16, DeepSpeed stage 1: its activations from the preset's shapes.
    experiment = experiment_of(ROOT / "experiments" / "engines_large.yaml", "precision=fp16").probe(3)
    spec = dataclasses.replace(trial_spec(experiment, Point("deepspeed", 1, 1, 1)), use_gpu=True)
    band = error_band.band_for(error_band.class_of_info(spec.model))
    steps = Steps(8, 512)
    search = SearchSpec(spec, SearchSpec(spec, 1000.0, steps).predicted_peak(128) + 3.0, steps)
    guess = search.first_guess()
    # A trial of its engine measured 2.5 GiB over its prediction (above the band's upper end here): the
    # guess drops to the largest size where that excess fits.
    missed = correction.Correction("stage1_mb64_w1", ("deepspeed", False), 1.15, 2.5, "")
    assert band.high_gib(search.predicted_peak(guess)) < missed.peak_gib(search.predicted_peak(guess))
    corrected = dataclasses.replace(search, correction=missed).first_guess()
    assert corrected < guess
    at = missed.peak_gib(search.predicted_peak(corrected))
    assert at <= search.budget_gib < missed.peak_gib(search.predicted_peak(steps.up(corrected)))
    # An excess within the band changes nothing: the band's upper end still holds.
    slight = dataclasses.replace(missed, excess_gib=0.1)
    assert dataclasses.replace(search, correction=slight).first_guess() == guess


def test_a_trial_driver_plans_its_share_again_from_its_engines_miss():
    from rank_group import experiment_of, trial_spec

    from ray_zero.config import Point
    from ray_zero.rows import trial_row
    from ray_zero.run.gpu_sharing import Room, memory_need
    from ray_zero.run.trial import planned

    experiment = experiment_of(ROOT / "experiments" / "engines_large.yaml", "precision=fp16")
    spec = dataclasses.replace(trial_spec(experiment, Point("deepspeed", 1, 256, 1)), use_gpu=True)
    need = memory_need(trial_row(spec), None, None)
    room = Room(0.92 * 80 * GIB, 0.0, 0.01)  # the step set aside smaller than this trial's corrected one
    spec = dataclasses.replace(spec, gpu_share=room.share(need, 1), gpu_room=room)
    assert planned(spec, Corrections()) == (spec, trial_row(spec))  # its row, nothing corrected
    found = Corrections(
        {("deepspeed", False): correction.Correction("stage1_mb64_w1", ("deepspeed", False), 1.2, 6.0, "")}
    )
    again, fields = planned(spec, found)
    assert again.gpu_share > spec.gpu_share and fields["corrected_from"].startswith("stage1_mb64_w1 measured")
    assert fields == trial_row(again) | {k: fields[k] for k in ("corrected_from", "corrected_peak_gib")}
    assert fields["corrected_peak_gib"] == pytest.approx(trial_row(spec)["predicted_peak_gib"] + 6.0)
    # Another engine's miss, or a trial that runs alone, keeps its plan.
    other = Corrections(
        {("fsdp", False): dataclasses.replace(found.by_engine[("deepspeed", False)], engine=("fsdp", False))}
    )
    assert planned(spec, other) == (spec, trial_row(spec))
    alone = dataclasses.replace(spec, gpu_share=1.0)
    assert planned(alone, found)[0] == alone
