"""Models users bring, trained for real on CPU through the whole path (Ray Tune -> Ray Train -> DeepSpeed):
a tiny GPT-2 and Llama from their Transformers configuration classes, a timm model, the example factory;
each at ZeRO stage 0 and 1 on 2 workers. Stage 1 holds half of stage 0's optimizer states per rank."""
from __future__ import annotations

import math

import pytest

from ray_zero.experiment_file import load_experiment
from ray_zero.sweep import run_sweep

SOURCES = {
    "gpt2": [],  # experiments/tiny_models_cpu.yaml as it ships
    "llama": ["model=hf:llama", "model_config={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
              "num_attention_heads: 4, num_key_value_heads: 4, vocab_size: 1000}"],
    "timm": ["model=timm:test_vit", "model_config={}", "seq_len=null", "grid.micro_batch_size=[2]"],
    "factory": ["model=examples/my_model.py:build", "model_config={features: 16, width: 64, depth: 2}",
                "seq_len=null"],
}


@pytest.mark.parametrize("source", SOURCES)
def test_each_model_source_trains_at_stage_0_and_1_with_two_workers(source, ray_instance, tmp_path):
    experiment = load_experiment("experiments/tiny_models_cpu.yaml", SOURCES[source])
    frame = run_sweep(experiment, tmp_path, command=f"pytest {source}").set_index("stage")
    assert list(frame["status"]) == ["ok", "ok"], frame["error"].tolist()
    assert (frame["loss_last"] < frame["loss_first"]).all(), frame[["loss_first", "loss_last"]]
    assert frame["loss_last"].map(math.isfinite).all() and (frame["dataset"] == "synthetic").all()
    halved = frame.loc[1, "optimizer_state_bytes_per_rank_max"] / frame.loc[0, "optimizer_state_bytes_per_rank_max"]
    assert abs(halved - 0.5) < 0.005, halved  # within 1% of half
    # The count the driver took on the meta device is the real model's, and FLOPs were counted.
    assert frame["params"].iloc[0] > 0 and frame["measured_model_state_gib"].notna().all()
