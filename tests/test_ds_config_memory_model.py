"""The DeepSpeed config builder (pure, then parsed by DeepSpeed itself) and the memory model."""
from __future__ import annotations

import pytest

from ray_zero.ds_config import build_ds_config
from ray_zero.memory_model import deepspeed, paper, predict_row


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_config_has_one_optimizer_and_the_batch_arithmetic(stage, precision):
    config = build_ds_config(stage=stage, micro_batch_size=16, gradient_accumulation_steps=4, world_size=8,
                             precision=precision, lr=3e-4)
    assert config["train_batch_size"] == 16 * 4 * 8
    assert config["train_micro_batch_size_per_gpu"] == 16 and config["gradient_accumulation_steps"] == 4
    assert config["optimizer"]["type"] == "AdamW" and config["optimizer"]["params"]["lr"] == 3e-4
    assert config["zero_optimization"]["stage"] == stage
    assert ("fp16" in config) == (precision == "fp16") and ("bf16" in config) == (precision == "bf16")
    assert ("allgather_bucket_size" in config["zero_optimization"]) == (stage in (1, 2))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_accepts_the_config(stage):
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig(build_ds_config(stage=stage, micro_batch_size=8, gradient_accumulation_steps=2,
                                             world_size=1, precision="bf16"))
    assert parsed.zero_optimization_stage == stage and parsed.train_batch_size == 16
    assert parsed.optimizer_name == "adamw"


@pytest.mark.parametrize("kwargs, match", [
    ({"stage": 4}, "stage must be 0, 1, 2 or 3"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"micro_batch_size": 0}, "micro_batch_size must be at least 1"),
])
def test_config_rejects_bad_arguments(kwargs, match):
    arguments = dict(stage=0, micro_batch_size=1, gradient_accumulation_steps=1, world_size=1, precision="fp32")
    with pytest.raises(ValueError, match=match):
        build_ds_config(**{**arguments, **kwargs})


def test_paper_figure_for_7_5b_parameters_on_64_gpus():
    psi, n = 7.5e9, 64
    got = [paper(int(psi), stage, n).model_state_bytes / 1e9 for stage in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_deepspeed_formula_for_the_measured_h200_rows():
    # Measured on H200 (results/memory_scaling): 18.10, 16.60 and 9.12 GiB peak allocated.
    psi = 805_888_010
    assert deepspeed(psi, 0, 1, "fp16").model_state_bytes == 16 * psi
    assert deepspeed(psi, 0, 1, "fp16").step_transient_bytes == 8 * psi  # fp32 gradient copies
    assert deepspeed(psi, 1, 2, "fp16").optimizer_state_bytes == 8 * psi / 2
    row = predict_row("large", 1, 2, "fp16", 64)
    assert 8.9 < row["predicted_peak_gib"] < 9.3
    assert deepspeed(psi, 1, 1, "fp16").bucket_bytes == 2 * 50_000_000  # the full bucket, model or not


def test_estimate_command_prints_the_table(cli):
    done = cli("estimate", "--model", "large", "--workers", "1,2,4,8")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "805,888,010 parameters" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 16  # 4 stages x 4 worker counts
    stage1 = {int(r[1]): float(r[7]) for r in rows if r[0] == "1"}  # ds_model_state_gib
    assert stage1[1] > stage1[2] > stage1[4] > stage1[8]
