"""The error band of a predicted peak (ray_zero/measure/error_band.py, issue 65): each class's band as the
GPU population measured it, widened outside the torch releases and GPU architecture it was measured on;
every GPU row and `estimate` line carries it, and `estimate`'s fit honours its upper end, the allocator's
reserve and the CUDA context."""

from __future__ import annotations

import pytest

import ray_zero
from ray_zero.measure import error_band
from ray_zero.rows import finish_row

TINY_GPT2 = dict(
    micro_batch_size=[4], stages=[1], precision="bf16",
    overrides=["model_config.n_layer=2", "model_config.n_embd=128", "model_config.n_head=2", "seq_len=128"],
)  # fmt: skip


def test_the_shipped_bands_come_from_the_tuning_families_of_an_sm90_gpu():
    measured = error_band.measured()
    assert measured["about"]["compute_capabilities"] == ["9.0"]
    assert "tuning" in measured["about"]["rows_from"] and measured["about"]["command"].startswith(
        "python bench/"
    )
    for name in (*error_band.CLASSES, error_band.ANY):
        band = error_band.band_for(name, "NVIDIA H100 80GB HBM3", "2.12.0")
        assert band.lower <= 0 <= band.upper and band.rows >= 10 and not band.widened


def test_the_band_widens_outside_the_measured_torch_and_gpu_and_says_why():
    held = error_band.band_for("Transformers text", "h200", "2.11.0")
    old_torch = error_band.band_for("Transformers text", "h200", "2.4.1")
    ampere = error_band.band_for("Transformers text", "NVIDIA A100-SXM4-80GB", "2.11.0")
    unknown = error_band.band_for("Transformers text", "MI300X", "2.11.0")
    assert (
        old_torch.upper == pytest.approx(error_band.WIDEN * held.upper) and "torch 2.4.1" in old_torch.widened
    )
    assert ampere.lower == pytest.approx(error_band.WIDEN * held.lower)
    assert "compute capability 8.0" in ampere.widened and "unknown GPU architecture" in unknown.widened
    assert "widened x2" in str(ampere)


def test_gpu_names_as_torch_smi_and_users_spell_them():
    assert error_band.compute_capability("NVIDIA H100 80GB HBM3") == "9.0"
    assert error_band.compute_capability("h200") == "9.0"
    assert error_band.compute_capability("NVIDIA A10") == "8.6"  # not an A100
    assert error_band.compute_capability("NVIDIA A100-SXM4-40GB") == "8.0"
    assert (
        error_band.compute_capability("GH200 480GB") == "9.0" and error_band.compute_capability("X") is None
    )


def test_a_gpu_row_says_whether_its_measured_peak_lies_inside_its_band():
    band = error_band.band_for("timm vision", "NVIDIA H100 80GB HBM3")
    row = dict(
        trial="stage1_mb4_w1", backend="deepspeed", stage=1, status="ok", memory_kind="cuda",
        model="timm:resnet18", band_class="timm vision", device_name="NVIDIA H100 80GB HBM3",
        predicted_peak_gib=10.0,
    )  # fmt: skip
    inside = finish_row({**row, "peak_allocated_gib_max": 10.0 * (1 + band.upper) - 0.01})
    outside = finish_row({**row, "peak_allocated_gib_max": 10.0 * (1 + band.upper) + 0.01})
    assert inside["inside_band"] is True and outside["inside_band"] is False
    assert inside["predicted_peak_high_gib"] == pytest.approx(10.0 * (1 + band.upper))
    assert finish_row({**row, "device_name": "Tesla V100-SXM2-32GB", "peak_allocated_gib_max": 10.0})[
        "predicted_band"
    ].endswith("is compute capability 7.0, the band's NVIDIA H100 80GB HBM3 9.0)")


def test_estimate_fits_only_with_the_band_the_reserve_and_the_context():
    found = ray_zero.estimate("hf:gpt2", gpu_gib=100, **TINY_GPT2)
    peak = float(found.table["peak_gib"].iloc[0])
    band = error_band.band_for("Transformers text", None)
    needed = error_band.needed_gib(band.high_gib(peak))
    assert found.rows[0]["band_class"] == "Transformers text" and "Error band of the peak" in found.head
    assert float(found.table["peak_high_gib"].iloc[0]) == pytest.approx(band.high_gib(peak))
    # A GPU that holds the predicted peak but not its upper end, reserve and context is no fit.
    tight = ray_zero.estimate("hf:gpt2", gpu_gib=needed - 0.01, **TINY_GPT2)
    roomy = ray_zero.estimate("hf:gpt2", gpu_gib=needed + 0.01, **TINY_GPT2)
    fits = lambda found: found.table.filter(like="fits_").iloc[0, 0]  # noqa: E731
    assert peak < needed - 0.01 and fits(tight) == "no" and fits(roomy) == "yes"
    assert "2.1 GiB of CUDA context" in tight.head


def test_estimate_names_the_gpu_the_band_is_checked_against():
    ampere = ray_zero.estimate("hf:gpt2", gpu="A100-SXM4-80GB", **TINY_GPT2)
    assert "compute capability 8.0" in ampere.rows[0]["predicted_band"] and "widened" in ampere.head
    with pytest.raises(ray_zero.ConfigError, match="^--gpu: give the GPU's name"):
        ray_zero.estimate("hf:gpt2", gpu=" ", **TINY_GPT2)
