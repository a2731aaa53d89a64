"""Calibration: per engine, three sizes, a line with its residual, and a verdict that marks the rows it
predicts when the line cannot be trusted. The fits on numbers (what GPU allocators gave on 2026-12-02:
a ViT whose first micro-batch hid its activations), then real calibration trials of a tiny GPT-2 at rank
level (CPU: autograd's saved bytes), written to calibration.json and read back by the memory model."""

from __future__ import annotations

import json

import pytest
from rank_group import describe, experiment_of, trial_spec

from ray_zero.measure import calibration
from ray_zero.measure.memory_model import predict_point

MIB = 2**20


def _rows(
    points: dict[int, float],
    backend: str = "deepspeed",
    autograd: dict[int, float] | None = None,
    checkpointing: bool = False,
) -> list[dict]:
    return [
        {
            "trial": f"{backend}_mb{m}_calibration",
            "backend": backend,
            "status": "ok",
            "micro_batch_size": m,
            "activation_checkpointing": checkpointing,
            "micro_batch_rise_bytes_per_rank_max": rise,
            "saved_for_backward_bytes_per_rank_max": (autograd or {}).get(m, rise),
        }
        for m, rise in points.items()
    ]


def test_a_straight_line_gives_its_slope_and_an_ok_verdict():
    [fit] = calibration.fit_lines(
        _rows({4: 500 * MIB + 4 * 90 * MIB, 8: 500 * MIB + 8 * 90 * MIB, 12: 500 * MIB + 12 * 90 * MIB}),
        on_gpu=True,
    )
    assert fit["verdict"] == "ok" and fit["bytes_per_sample"] == pytest.approx(90 * MIB)
    assert fit["intercept_bytes"] == pytest.approx(500 * MIB) and fit["max_residual_bytes"] < 1


def test_doubtful_fits_say_why():
    # The ViT of 2026-12-02: its first micro-batch's rise was the gradients' (2.026 and 2.028 GiB peaks).
    [zero] = calibration.fit_lines(
        _rows({1: 2.026 * 1024 * MIB, 2: 2.0262 * 1024 * MIB, 3: 2.0264 * 1024 * MIB}), True
    )
    assert zero["verdict"].startswith("doubtful: zero")
    [bent] = calibration.fit_lines(_rows({2: 100 * MIB, 4: 200 * MIB, 6: 500 * MIB}), True)
    assert bent["verdict"].startswith("doubtful: not linear")
    line = {m: 10 * MIB + m * 50 * MIB for m in (2, 4, 6)}
    [apart] = calibration.fit_lines(_rows(line, autograd={m: m * 5 * MIB for m in line}), True)
    assert apart["verdict"].startswith("doubtful: 10.00x autograd")
    [agrees] = calibration.fit_lines(_rows(line, autograd={m: m * 40 * MIB for m in line}), True)
    assert agrees["verdict"] == "ok" and agrees["autograd_bytes_per_sample"] == pytest.approx(40 * MIB)
    [one] = calibration.fit_lines(_rows({2: 100 * MIB}) + [{**_rows({4: 0})[0], "status": "oom"}], True)
    assert one["bytes_per_sample"] is None and one["verdict"].startswith("not measured (1 of 2")


def test_each_engine_predicts_from_its_own_line_and_doubt_reaches_the_row(tmp_path):
    experiment = experiment_of(
        "experiments/tiny_models_cpu.yaml", "grid.backend=[deepspeed,torch_zero]", "grid.stage=[1]"
    )
    rows = _rows({2: 2 * 30 * MIB, 4: 4 * 30 * MIB, 6: 6 * 30 * MIB}) + _rows(
        {2: 40 * MIB, 4: 200 * MIB, 6: 250 * MIB}, backend="torch_zero"
    )
    written = calibration.write_calibration(tmp_path, experiment, rows, True, "bf16")
    assert json.loads((tmp_path / calibration.CALIBRATION_FILE).read_text()) == written
    assert written["by_backend"]["deepspeed"]["plain"] == pytest.approx(30 * MIB)
    assert "torch_zero: doubtful: not linear" in calibration.summary(written)

    def predicted(backend: str):
        row = {
            "backend": backend,
            "params": 1000,
            "stage": 1,
            "num_workers": 1,
            "precision": "bf16",
            "memory_kind": "cuda",
            "model": "hf:gpt2",
            "micro_batch_size": 10,
        }
        return predict_point(row, written)

    assert predicted("deepspeed").activation_bytes == pytest.approx(300 * MIB)
    assert predicted("deepspeed").basis.endswith("activations calibrated")
    assert "doubtful: not linear" in predicted("torch_zero").basis
    # FSDP2 was not calibrated here: the first engine's line, and the row says whose it is.
    assert predicted("fsdp").basis.endswith("activations calibrated on deepspeed")
    # A calibration.json of an earlier version (one figure for every engine) still predicts.
    older = {"bytes_per_sample": {"plain": 2 * MIB}}
    assert predict_point({**_row_of(), "backend": "fsdp"}, older).activation_bytes == 20 * MIB


def _row_of():
    return {
        "params": 1000,
        "stage": 2,
        "num_workers": 1,
        "precision": "bf16",
        "memory_kind": "cuda",
        "model": "hf:gpt2",
        "micro_batch_size": 10,
    }


def test_sizes_make_activations_dominate_the_gradients():
    class Info:
        params, trainable_params = 100_000_000, 100_000_000
        saved_bytes_per_sample = 90 * MIB  # in fp32, as counted on the meta device

    # bf16: 45 MiB a sample against 2 x 200 MB of gradients: the smallest size holds 9 samples.
    assert calibration.calibration_sizes(Info(), "bf16") == [9, 18, 27]
    assert calibration.calibration_sizes(None) == [1, 2, 3]
    # On a GPU at least 1 GiB at the smallest size, above cuDNN's per-shape workspaces: 23 samples.
    assert calibration.calibration_sizes(Info(), "bf16", on_gpu=True) == [23, 46, 69]
    experiment = experiment_of(
        "experiments/tiny_models_cpu.yaml",
        "grid.backend=[deepspeed,torch_zero,fsdp]",
        "grid.stage=[2]",
        "grid.activation_checkpointing=[false,true]",
    )
    points = calibration.calibration_points(experiment, Info(), "bf16")
    assert {(p.backend, p.stage, p.num_workers) for p in points} == {
        ("deepspeed", 0, 1),
        ("torch_zero", 0, 1),
        ("fsdp", 2, 1),
    }
    assert len(points) == 3 * 2 * 3  # engines x checkpointing x sizes


def test_real_calibration_trials_fit_a_line_on_a_rank(ranks, tmp_path):
    # CPU: autograd's saved bytes of one steady-state micro-batch (second step) of a tiny GPT-2.
    experiment = experiment_of("experiments/tiny_models_cpu.yaml", "calibrate=true")
    probe = calibration.probe_experiment(experiment)
    model = describe(experiment)
    rows = []
    for point in calibration.calibration_points(experiment, model, "fp32"):
        spec = trial_spec(probe, point)
        rows.append(ranks(1).row(spec))
    assert [r["status"] for r in rows] == ["ok"] * 3 and {r["steps"] for r in rows} == {
        calibration.CALIBRATION_STEPS
    }
    found = calibration.write_calibration(tmp_path, experiment, rows, False, "fp32")
    [fit] = found["fits"]
    assert fit["verdict"] == "ok" and fit["bytes_per_sample"] > 0, fit
    # autograd's count is exact: the three points lie on the line to within a few bytes per sample.
    assert fit["max_residual_bytes"] < 0.01 * fit["bytes_per_sample"]


def test_a_small_end_above_the_line_does_not_tilt_the_slope():
    # BERT-large's DeepSpeed calibration on an H200 (2026-12-04): micro-batch 2 sat 0.26 GiB above the line
    # that 4, 6, 8 and 16 followed; least squares fitted 437 MiB a sample, the larger sizes rose 504.
    [fit] = calibration.fit_lines(_rows({2: 1341844480, 4: 2115827200, 6: 3173180928}), True)
    assert fit["least_squares_bytes_per_sample"] == pytest.approx(457834112)
    assert fit["bytes_per_sample"] == pytest.approx((3173180928 - 2115827200) / 2)
    # A larger point below the line (a baseline shift, DDP's at the same run) keeps the least-squares slope.
    [shifted] = calibration.fit_lines(_rows({2: 2058483712, 4: 3443059200, 6: 3524082688}), True)
    assert shifted["bytes_per_sample"] == shifted["least_squares_bytes_per_sample"]
    assert shifted["verdict"].startswith("doubtful: not linear")


def test_calibrate_auto_measures_only_what_could_not_be_traced():
    experiment = experiment_of(
        "experiments/tiny_models_cpu.yaml", "grid.backend=[deepspeed,fsdp]", "grid.stage=[1,3]"
    )
    untraced = {("fsdp", False)}
    assert calibration.engines_to_calibrate(experiment, True, untraced) == untraced
    assert calibration.engines_to_calibrate(experiment, True, set()) == set()
    assert calibration.engines_to_calibrate(experiment, False, untraced) == set()  # CPU: no peak predicted
    everything = {("deepspeed", False), ("fsdp", False)}
    checked = experiment.model_copy(update={"calibrate": True})
    assert calibration.engines_to_calibrate(checked, False, set()) == everything  # a check beside the trace
    assert (
        calibration.engines_to_calibrate(experiment.model_copy(update={"calibrate": False}), True, untraced)
        == set()
    )
    points = calibration.calibration_points(experiment, None, "bf16", True, untraced)
    assert {p.backend for p in points} == {"fsdp"} and len(points) == calibration.SIZES


def test_a_traced_row_keeps_its_traced_term_and_shows_the_calibrated_one_beside_it():
    from ray_zero.rows import prediction_fields

    row = {**_row_of(), "traced_activation_bytes": 100 * MIB}
    written = {"by_backend": {"deepspeed": {"plain": 3 * MIB}}, "fits": []}
    fields = prediction_fields(row, written)
    assert fields["activation_source"] == "traced"
    assert fields["predicted_activation_gib"] == pytest.approx(100 * MIB / 2**30)
    assert fields["calibrated_activation_gib"] == pytest.approx(30 * MIB / 2**30)
    assert fields["predicted_peak_calibrated_gib"] < fields["predicted_peak_gib"]
    untraced = prediction_fields({**_row_of(), "trace_note": "reads a value of its data"}, written)
    assert untraced["activation_source"] == "calibrated" and "calibrated_activation_gib" not in untraced
    # A checkpointed row's basis says it is unchecked; its term is still the traced one (not "preset shapes").
    checkpointed = {**row, "stage": 1, "precision": "fp16", "activation_checkpointing": True}
    assert prediction_fields(checkpointed, None)["activation_source"] == "traced"
