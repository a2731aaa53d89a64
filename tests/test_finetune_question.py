"""bench/finetune_question.py: the longest sequence `estimate` says fits, and DeepSpeed's estimator as it
prints, on a tiny Llama with LoRA (meta device, seconds)."""

import sys
from pathlib import Path

import pytest

import ray_zero
from ray_zero.measure import error_band

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import finetune_question  # noqa: E402

TINY = {
    "model": "hf:llama",
    "model_config": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    },
    "finetune": {"lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
    "steps": 2,
    "warmup_steps": 1,
    "device": "gpu",
    "precision": "bf16",
    "grid": {"micro_batch_size": [1], "seq_len": [64]},
}


def test_the_answer_fits_and_one_step_longer_does_not():
    at = ray_zero.estimate(
        TINY,
        backend="deepspeed",
        stages=[3],
        workers=[2],
        micro_batch_size=1,
        seq_len=320,
        gpu="h100",
        gpu_gib=80,
    )
    budget = error_band.needed_gib(at.rows[0]["predicted_peak_high_gib"])  # ZeRO-3 x2 fits 320 tokens exactly
    found = finetune_question.longest(
        TINY,
        gpu="h100",
        gpu_gib=budget,
        lengths=[64, 128, 256, 512, 1024],
        step=64,
        workers=[2],
        backends=["deepspeed"],
        checkpointing=(False,),
        log=lambda _: None,
    )
    three = next(s for s in found if s.stage == 3)
    assert (three.lo, three.hi) == (320, 384)
    for s in found:  # each answer's verdicts are estimate's own: the answer fits, one step longer not
        assert s.verdict[s.lo] and (s.hi is None or (s.hi == s.lo + 64 and not s.verdict[s.hi]))
        assert all(ok == (n <= s.lo) for n, ok in s.verdict.items())


@pytest.mark.parametrize(
    "stage, expected", [(2, (2e9 + 9e9) / 2**30), (3, (4 * 1e8 + 18e9 / 2) / 2**30)], ids=["zero2", "zero3"]
)
def test_deepspeed_estimator_is_read_from_what_it_prints(stage, expected):
    said = finetune_question.deepspeed_says(stage, params=10**9, largest_layer=10**8, gpus=2)
    assert said == pytest.approx(expected, abs=0.006)
    assert finetune_question.deepspeed_says(1, params=10**9, largest_layer=10**8, gpus=2) is None
