"""Models users bring, trained by a rank as a Ray Train worker trains them (ray_zero.train.worker.train under
torch.distributed, gloo, 2 ranks, real DeepSpeed): a tiny GPT-2 and Llama from their Transformers
configuration classes, a timm model, the example factory; each at ZeRO stage 0 and 1. Stage 1 holds half
of stage 0's optimizer states per rank. The same through Ray, for a factory: tests/test_faults.py."""

from __future__ import annotations

import math

import pytest
from conftest import ROOT
from rank_group import experiment_of, trial_specs

SOURCES = {
    "gpt2": [],  # experiments/tiny_models_cpu.yaml as it ships
    "llama": [
        "model=hf:llama",
        "model_config={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
        "num_attention_heads: 4, num_key_value_heads: 4, vocab_size: 1000}",
    ],
    "timm": ["model=timm:test_vit", "model_config={}", "seq_len=null", "grid.micro_batch_size=[2]"],
    "factory": [
        "model=examples/my_model.py:build",
        "model_config={features: 16, width: 64, depth: 2}",
        "seq_len=null",
    ],
}


@pytest.mark.parametrize("source", SOURCES)
def test_each_model_source_trains_at_stage_0_and_1_on_two_ranks(source, ranks, monkeypatch):
    monkeypatch.chdir(ROOT)  # the factory's path is read from the working directory, as a sweep reads it
    experiment = experiment_of("experiments/tiny_models_cpu.yaml", *SOURCES[source])
    specs = trial_specs(experiment)
    assert sorted((s.point.stage, s.point.num_workers) for s in specs.values()) == [(0, 2), (1, 2)], sorted(
        specs
    )
    rows = {spec.point.stage: ranks(2).row(spec) for spec in specs.values()}
    for stage, row in rows.items():
        assert row["status"] == "ok", row.get("error")
        assert row["loss_last"] < row["loss_first"] and math.isfinite(row["loss_last"]), row
        assert row["dataset"] == "synthetic" and len(row["per_rank"]) == 2
        # The count the driver took on the meta device is the real model's, and FLOPs were counted.
        assert row["params"] > 0 and row["flops_per_sample"] > 0 and row["measured_model_state_gib"] > 0
        # fp32, replicated at stages 0 and 1; DeepSpeed's flat buffer pads to an alignment (3 elements seen)
        padding = [r["parameter_bytes"] - 4 * row["params"] for r in row["per_rank"]]
        assert all(0 <= extra < 64 for extra in padding), padding
    halved = rows[1]["optimizer_state_bytes_per_rank_max"] / rows[0]["optimizer_state_bytes_per_rank_max"]
    assert abs(halved - 0.5) < 0.005, halved  # within 1% of half


def test_each_point_of_a_seq_len_axis_trains_at_its_own_length(ranks):
    # grid.seq_len on a rank: each point's batches have its length (the saved activations grow with it),
    # and its row records the length, its own sample bytes and FLOPs (the model described at each value).
    experiment = experiment_of(
        "experiments/tiny_models_cpu.yaml", "seq_len=null", "grid.stage=[1]", "grid.num_workers=[1]",
        "grid.seq_len=[32,128]",
    )  # fmt: skip
    specs = trial_specs(experiment)
    assert sorted(specs) == ["stage1_mb4_w1_s128", "stage1_mb4_w1_s32"], sorted(specs)
    short, long = (ranks(1).row(specs[f"stage1_mb4_w1_s{n}"]) for n in (32, 128))
    assert short["status"] == long["status"] == "ok", (short.get("error"), long.get("error"))
    assert (short["seq_len"], long["seq_len"]) == (32, 128)
    assert long["sample_bytes"] == 4 * short["sample_bytes"]
    assert long["flops_per_sample"] > 3.5 * short["flops_per_sample"]
    assert long["saved_for_backward_bytes_per_rank_max"] > 3 * short["saved_for_backward_bytes_per_rank_max"]
