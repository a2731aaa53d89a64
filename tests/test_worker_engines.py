"""The memory design space as a rank trains it (ray_zero.train.worker.train on 2 ranks under gloo, the seed
model on synthetic batches): DeepSpeed ZeRO, PyTorch's ZeRO-1 (DDP + ZeroRedundancyOptimizer) and
FSDP2, each with its stages, with and without activation checkpointing; the combinations an engine
lacks are skipped rows with the reason. The engines themselves, on a toy model: tests/test_engines.py."""

from __future__ import annotations

import math

import pytest
from rank_group import experiment_of, skipped_rows, trial_specs

GRID = [
    "steps=5",
    "warmup_steps=1",
    "dataset=synthetic",
    "grid.backend=[deepspeed,torch_zero,fsdp]",
    "grid.stage=[1,3]",
    "grid.num_workers=[2]",
    "grid.activation_checkpointing=[false,true]",
]


@pytest.fixture(scope="module")
def engines(ranks):
    """{trial name: row} of the grid, each trained by the same two ranks in turn."""
    experiment = experiment_of("experiments/quick.yaml", *GRID)
    return {name: ranks(2).row(spec) for name, spec in trial_specs(experiment).items()}


def test_every_engine_and_stage_trains_with_and_without_checkpointing(engines):
    assert sorted(engines) == sorted(
        f"{prefix}stage{stage}_mb64_w2{ac}"
        for prefix, stage in (("", 1), ("", 3), ("torch_zero_", 1), ("fsdp_", 3))
        for ac in ("", "_ac")
    )
    for name, row in engines.items():
        assert row["status"] == "ok", (name, row["error"])
        assert row["loss_last"] < row["loss_first"] and math.isfinite(row["loss_last"]), name
        assert row["backend"] == {"torch": "torch_zero", "fsdp": "fsdp"}.get(name.split("_")[0], "deepspeed")


def test_engines_lacking_a_stage_are_skipped_rows_with_the_reason():
    skipped = skipped_rows(experiment_of("experiments/quick.yaml", *GRID))
    assert sorted((row["trial"], row["status"], row["error"]) for row in skipped) == [
        (f"fsdp_stage1_mb64_w2{ac}", "skipped", "fsdp has stages 2, 3, not 1") for ac in ("", "_ac")
    ] + [
        (f"torch_zero_stage3_mb64_w2{ac}", "skipped", "torch_zero has stages 0, 1, not 3")
        for ac in ("", "_ac")
    ]


def test_checkpointing_keeps_fewer_bytes_for_backward_and_the_same_loss(engines):
    for name, row in engines.items():
        if name.endswith("_ac"):
            continue
        checkpointed = engines[f"{name}_ac"]
        assert (
            checkpointed["saved_for_backward_bytes_per_rank_max"]
            < row["saved_for_backward_bytes_per_rank_max"]
        ), name
        assert checkpointed["loss_last"] == pytest.approx(
            row["loss_last"], rel=1e-4
        )  # same seed, fp32: the same training


def test_sharded_engines_split_the_optimizer_states(engines):
    for name in ("fsdp_stage3_mb64_w2", "torch_zero_stage1_mb64_w2", "stage1_mb64_w2", "stage3_mb64_w2"):
        states = [rank["optimizer_state_bytes"] for rank in engines[name]["per_rank"]]
        # ZeroRedundancyOptimizer gives whole tensors to ranks: only about half each.
        assert max(states) / sum(states) <= (0.60 if name.startswith("torch_zero") else 0.51), (name, states)


def test_measured_model_states_are_the_memory_models(engines):
    # fp32 on CPU: what each rank holds, tensor by tensor, against the prediction. The memory model knows
    # ZeRO-3's persistent small parameters (under 1e5 elements: all of the seed model's, kept whole on every
    # rank beside their partition) and each engine's split of the seed model's tensors; what remains is
    # Adam's 4-byte step counters.
    for name, row in engines.items():
        ratio = row["measured_model_state_gib"] / row["predicted_model_state_gib"]
        assert 1 <= ratio <= 1.001, (name, ratio)


def test_offloaded_states_are_counted_where_a_cpu_rank_holds_them(ranks):
    # On CPU the host is the device: with the optimizer offloaded, the rank holds what it holds without
    # offload, and the memory model predicts that (not the device's share of a GPU rank).
    experiment = experiment_of(
        "experiments/quick.yaml",
        *GRID[:3],
        "grid.backend=[deepspeed]",
        "grid.stage=[1,2,3]",
        "grid.num_workers=[2]",
        "grid.offload_optimizer=[cpu]",
    )
    rows = {name: ranks(2).row(spec) for name, spec in trial_specs(experiment).items()}
    ratios = {n: r["measured_model_state_gib"] / r["predicted_model_state_gib"] for n, r in rows.items()}
    assert all(r["status"] == "ok" for r in rows.values()) and len(rows) == 3
    # Measured 2026-12-03: stages 1 and 2 count 0.965 of it, stage 3 1.000 (the device's share alone
    # would have been predicted 2.3-3x below the count).
    assert all(0.95 <= ratio <= 1.001 for ratio in ratios.values()), ratios
