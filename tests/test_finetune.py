"""Fine-tuning (issue 66 item 3) on the CPU: a tiny Llama from its Transformers config class (no weights)
with LoRA adapters (peft) on q_proj and v_proj, and the same model with its embedding and first layer
frozen by name pattern.

At 2 ranks under gloo (ray_zero.train.worker.train, real DeepSpeed and torch engines), on DeepSpeed
ZeRO-1 and ZeRO-3, DDP + ZeroRedundancyOptimizer and FSDP2: what each rank holds, tensor by tensor, is
the state model's frozen/trainable split (ray_zero/measure/partitions.py) to the byte. On the meta
device: the described model is the trained one, the traced step makes gradients of the trainable
parameters only and saves nothing for a frozen first layer, and `estimate` counts master copies and
Adam's states of the trainable parameters only. Bad input: tests/test_bad_input.py.
"""

from __future__ import annotations

import math

import pytest
from rank_group import describe, experiment_of, trial_specs

from ray_zero.measure.memory_model import predict_point
from ray_zero.measure.prediction import GIB

LLAMA = [
    "model=hf:llama",
    "model_config={num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4, "
    "num_key_value_heads: 2, vocab_size: 2000, bos_token_id: 0, eos_token_id: 0}",
    "seq_len=32",
]
FINETUNE = {
    "lora": "finetune={lora: {r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}}",
    "frozen": "finetune={freeze: ['model.embed_tokens.*', 'model.layers.0.*']}",
}
# The tiny Llama: embedding and lm_head (untied) 2000 x 64, the two tensors over ZeRO-3's 1e5-element
# persistence threshold; per layer q 64x64, k and v 32x64, o 64x64, gate and up 128x64, down 64x128, two
# norms of 64; the final norm 64. Every first dimension is even: FSDP2's and ZeRO-3's halves are exact.
EMBEDDING = 2000 * 64
LAYER = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64 + 2 * 64
ALL = 2 * EMBEDDING + 2 * LAYER + 64
# LoRA r 4: q's A 4x64 and B 64x4, v's A 4x64 and B 32x4, in each of the two layers.
LORA_TRAINS = 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
FROZEN_TRAINS = ALL - EMBEDDING - LAYER
GRID = [
    "steps=5",
    "warmup_steps=1",
    "optimizer={lr: 0.01}",
    "grid.micro_batch_size=[2]",
    "grid.num_workers=[2]",
    "grid.backend=[deepspeed,torch_zero,fsdp]",
    "grid.stage=[1,3]",  # DeepSpeed 1 and 3, DDP + ZeroRedundancyOptimizer, FSDP2 3
]
STATES = ("parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes")


KINDS = ("lora", "frozen", "lora bf16")
"""fp32 (the CPU's default) and, with LoRA, bf16: DeepSpeed and FSDP2 cast the frozen weights too."""


def _experiment(kind: str, *more: str):
    name, *precision = kind.split()
    precision = [f"precision={p}" for p in precision]
    return experiment_of("experiments/tiny_models_cpu.yaml", *LLAMA, FINETUNE[name], *precision, *more)


@pytest.fixture(scope="module")
def tuned(ranks) -> dict[tuple[str, str], dict]:
    """{(lora | frozen | lora bf16, trial name): row}, each trained by the session's two ranks in turn."""
    return {
        (kind, name): ranks(2).row(spec)
        for kind in KINDS
        for name, spec in trial_specs(_experiment(kind, *GRID)).items()
    }


def test_the_rows_say_how_many_parameters_trained_and_each_engine_trains_them(tuned):
    assert sorted(name for kind, name in tuned if kind == "lora bf16") == [
        "fsdp_stage3_mb2_w2",
        "stage1_mb2_w2",
        "stage3_mb2_w2",
        "torch_zero_stage1_mb2_w2",
    ]
    for (kind, name), row in tuned.items():
        assert row["status"] == "ok", (kind, name, row["error"])
        assert math.isfinite(row["loss_last"]) and row["loss_last"] < row["loss_first"], (kind, name)
        lora = kind.startswith("lora")
        assert row["trainable_params"] == (LORA_TRAINS if lora else FROZEN_TRAINS), (kind, name)
        assert row["params"] == ALL + (LORA_TRAINS if lora else 0), (kind, name)


def test_each_engine_holds_the_state_models_frozen_trainable_split_to_the_byte(tuned):
    """Parameters, gradients and master copies to the byte on the fullest rank; optimizer states to the
    byte plus Adam's 4-byte step counter per tensor the rank steps (kept on the host on a GPU: the model
    leaves it out)."""
    for key, row in tuned.items():
        predicted = predict_point(row)
        tensors = len(describe(_experiment(key[0])).trainable_param_shapes)
        assert row["precision"] == ("bf16" if "bf16" in key[0] else "fp32"), key
        for state in STATES:
            measured, expected = row[f"{state}_per_rank_max"], getattr(predicted, state)
            if state == "optimizer_state_bytes":
                assert expected < measured <= expected + 4 * tensors and measured % 4 == 0, (key, measured)
            else:
                assert measured == expected, (key, state, measured, expected)


def test_frozen_parameters_are_held_but_get_no_gradient_master_or_adam_state(tuned):
    for kind, trains in (("lora", LORA_TRAINS), ("frozen", FROZEN_TRAINS)):
        params = tuned[(kind, "stage1_mb2_w2")]["params"]
        ddp = tuned[(kind, "torch_zero_stage1_mb2_w2")]["per_rank"]
        # DDP: every parameter on every rank, gradients of the trainable ones only (its buckets likewise);
        # ZeroRedundancyOptimizer splits the trainable ones' Adam states.
        assert [r["parameter_bytes"] for r in ddp] == [4 * params] * 2
        assert [r["gradient_bytes"] for r in ddp] == [4 * trains] * 2
        assert sum(r["optimizer_state_bytes"] for r in ddp) < 8 * trains + 4 * 64
        # DeepSpeed ZeRO-1: the flat fp32 master partition is half the trainable ones (padded to 2N).
        zero1 = tuned[(kind, "stage1_mb2_w2")]["per_rank"]
        assert [r["master_param_bytes"] for r in zero1] == [4 * math.ceil(trains / 4) * 4 // 2] * 2
        # ZeRO-3 partitions every parameter, frozen too: half of each, and the tensors of at most 1e5
        # elements (all but the embedding and lm_head) also whole on every rank; the fp32 master and the
        # gradient partition of the trainable ones only.
        zero3 = tuned[(kind, "stage3_mb2_w2")]
        assert zero3["parameter_bytes_per_rank_max"] == 4 * (params // 2 + params - 2 * EMBEDDING)
        assert (
            zero3["master_param_bytes_per_rank_max"]
            == zero3["gradient_bytes_per_rank_max"]
            == 4 * trains // 2
        )
        # FSDP2 shards every parameter's rows, frozen too; gradients and states of the trainable ones only.
        fsdp = tuned[(kind, "fsdp_stage3_mb2_w2")]
        assert fsdp["parameter_bytes_per_rank_max"] == 4 * params // 2
        assert fsdp["gradient_bytes_per_rank_max"] == 4 * trains // 2
    # bf16 DeepSpeed ZeRO-1: every weight in bf16 on every rank, frozen ones too (the 1,792 trainable ones
    # fill the flat buffer without padding); an fp32 master of half the trainable ones.
    zero1 = tuned[("lora bf16", "stage1_mb2_w2")]
    assert zero1["parameter_bytes_per_rank_max"] == 2 * (ALL + LORA_TRAINS)
    assert zero1["master_param_bytes_per_rank_max"] == 4 * LORA_TRAINS // 2


def test_the_described_model_is_the_one_the_ranks_train():
    lora = describe(_experiment("lora"))
    assert lora.trainable_params == LORA_TRAINS and lora.params == ALL + LORA_TRAINS
    assert f"({ALL:,} of them frozen)" in lora.description
    # PEFT's module order: the wrapped layer's weight, then its adapter's A and B.
    assert lora.trainable_param_shapes[:2] == ((4, 64), (64, 4))
    frozen = describe(_experiment("frozen"))
    assert frozen.trainable_params == FROZEN_TRAINS and frozen.params == ALL
    assert (2000, 64) in frozen.frozen_param_shapes and (2000, 64) in frozen.trainable_param_shapes  # lm_head


def test_the_traced_step_makes_no_weight_gradient_for_frozen_parameters():
    from ray_zero.train.grid_trace import trace_grid

    def step(*finetune: str):
        experiment = experiment_of("experiments/tiny_models_cpu.yaml", *LLAMA, *finetune, "precision=bf16")
        points = [p for p in experiment.grid.points() if p.stage == 1]
        (traced,) = trace_grid(experiment.model_source(), points, "bf16").values()
        return traced.at(4)

    def blocks(shapes) -> int:  # bf16 gradients, each in the CUDA allocator's 512-byte blocks
        return sum(512 * math.ceil(2 * math.prod(shape) / 512) for shape in shapes)

    full, lora, frozen = step(), step(FINETUNE["lora"]), step(FINETUNE["frozen"])
    # DeepSpeed's bf16 module: a gradient of each trainable parameter, none of a frozen one.
    assert (
        full.gradient_bytes
        == blocks(describe(experiment_of("experiments/tiny_models_cpu.yaml", *LLAMA)).trainable_param_shapes)
        >= 2 * ALL
    )
    for kind, traced, trains in (("lora", lora, LORA_TRAINS), ("frozen", frozen, FROZEN_TRAINS)):
        shapes = describe(_experiment(kind)).trainable_param_shapes
        assert traced.gradient_bytes == blocks(shapes) < 2 * trains + 512 * len(shapes)
    # Backward still runs through LoRA's frozen layers for the input gradients; with nothing trainable
    # below it, the frozen first layer keeps nothing for backward.
    assert frozen.saved_bytes < full.saved_bytes and lora.saved_bytes > frozen.saved_bytes


def test_estimate_counts_master_copies_and_adam_states_of_the_trainable_parameters_only(capsys):
    import ray_zero

    def rows(*finetune: str):
        found = ray_zero.estimate(
            "hf:llama",
            overrides=[*LLAMA[1:], *finetune],
            stages=[1, 3],
            workers=[2],
            micro_batch_size=2,
            precision="bf16",
            gpu_gib=80,
        )
        return {row["stage"]: row for row in found.rows}

    full, lora, frozen = rows(), rows(FINETUNE["lora"]), rows(FINETUNE["frozen"])
    for tuned, trains in ((lora, LORA_TRAINS), (frozen, FROZEN_TRAINS)):
        for stage in (1, 3):
            assert tuned[stage]["trainable_params"] == trains
            for term in ("master_param", "optimizer_state"):
                ratio = tuned[stage][f"predicted_{term}_gib"] / full[stage][f"predicted_{term}_gib"]
                assert ratio == pytest.approx(trains / ALL, abs=0.002), (stage, term)
        # ZeRO-1 at 2 ranks: the fp32 master and Adam's two states of half the trainable ones (padded to 4).
        half = math.ceil(trains / 4) * 4 // 2
        assert tuned[1]["predicted_master_param_gib"] * GIB == pytest.approx(4 * half)
        assert tuned[1]["predicted_optimizer_state_gib"] * GIB == pytest.approx(8 * half)
        # The bf16 parameters are all held, frozen ones too.
        assert tuned[1]["predicted_parameter_gib"] == pytest.approx(
            full[1]["predicted_parameter_gib"], rel=0.02
        )
    # The command line reads the section the same way: its head names the frozen parameters.
    from ray_zero.__main__ import main

    args = ["estimate", "--model", "hf:llama", "--set", LLAMA[1], "--set", FINETUNE["lora"], "--stages", "1"]
    assert main([*args, "--workers", "2", "--micro-batch-size", "2", "--precision", "bf16"]) == 0
    assert f"{ALL + LORA_TRAINS:,} parameters ({ALL:,} of them frozen)" in capsys.readouterr().out
