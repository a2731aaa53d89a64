"""The engine's own work in a predicted step (issue 67, measure/engine_time.py): the communication each
engine's overlap rule leaves exposed, at a bus bandwidth, and the host's time in its hooks, on a hand model
of 32 square 1024 x 1024 weights in 8 blocks (bf16, 2 bytes a parameter), hand numbers throughout."""

from __future__ import annotations

import types

import pytest

from ray_zero.measure.bandwidth import given
from ray_zero.measure.engine_time import engine_time, hooks_per_micro_batch
from ray_zero.measure.step_time import StepTime

PSI = 32 * 2**20
"""The model's parameters: 32 tensors of 2^20."""
MODEL = types.SimpleNamespace(
    params=PSI,
    trainable_param_shapes=((1024, 1024),) * 32,
    frozen_param_shapes=(),
    buffer_bytes=0,
    batch_norm_param_shapes=(),
    largest_block_params=4 * 2**20,
    blocks=8,
    modules=30,
)
BUSBW = 100.0
"""GB/s: bf16's 2 PSI bytes (67.1 MB) take 671 us at a bus factor of 1."""
BF16_PSI_S = 2 * PSI / (BUSBW * 1e9)


def _kernels(micro_batch_s: float, accumulation: int = 1) -> StepTime:
    """A step of compute-bound micro-batches of `micro_batch_s` each and a 1 ms optimizer step."""
    return StepTime(micro_batch_s, 0.0, 0.0, 1e-3, 0, accumulation)


def _point(backend: str, stage: int, workers: int):
    return types.SimpleNamespace(backend=backend, stage=stage, num_workers=workers)


def _engine(backend, stage, workers, micro_batch_s, busbw=BUSBW, hook_s=None, model=MODEL, accumulation=1):
    step = _kernels(micro_batch_s, accumulation)
    return engine_time(step, model, _point(backend, stage, workers), "bf16", given(busbw), hook_s, 5e7)


ENGINES = [("deepspeed", 1), ("deepspeed", 3), ("fsdp", 3), ("torch_zero", 0)]


@pytest.mark.parametrize("backend,stage", ENGINES)
def test_one_worker_sends_nothing_and_two_do(backend, stage):
    alone, terms = _engine(backend, stage, 1, micro_batch_s=1e-4)
    assert alone.comm_s == 0 and terms.comm_s == 0 and alone.step_s == pytest.approx(1.1e-3)
    pair, terms = _engine(backend, stage, 2, micro_batch_s=1e-4)
    assert terms.comm_s > 0.5 * BF16_PSI_S and pair.comm_s > 0  # the gradients, at least
    assert pair.step_s == pytest.approx(1.1e-3 + pair.comm_s)


def test_zero1_exposes_all_it_sends_and_zero3_hides_all_but_a_block_behind_long_compute():
    # ZeRO-1 at 2: the bf16 gradients all-reduced (bus factor 1) and the parameters all-gathered (1/2),
    # 1.5 units, all exposed (DeepSpeed's overlap_comm is off below stage 3); ZeRO-3 (as comm_model
    # counts DeepSpeed 0.19: one gather a micro-batch, held to the backward) sends 1 unit: a reduce-scatter
    # and an all-gather at 1/2
    for micro_batch_s in (1e-6, 1.0):
        zero1, terms1 = _engine("deepspeed", 1, 2, micro_batch_s)
        assert terms1.comm_s == pytest.approx(1.5 * BF16_PSI_S, rel=1e-6) and zero1.comm_s == terms1.comm_s
    zero3, terms3 = _engine("deepspeed", 3, 2, micro_batch_s=1e-6)  # nothing to hide behind
    assert terms3.comm_s == pytest.approx(BF16_PSI_S, rel=1e-6)
    assert zero3.comm_s == pytest.approx(terms3.comm_s)
    zero3, _ = _engine("deepspeed", 3, 2, micro_batch_s=1.0)  # a block's gather and reduce-scatter exposed
    block_s = 0.5 * 2 * MODEL.largest_block_params / (BUSBW * 1e9)
    assert zero3.comm_s == pytest.approx(2 * block_s, rel=1e-5)
    # FSDP2 stage 3 gathers again for the backward: more sent than stage 2 (gradients reduced in fp32)
    _, fsdp2 = _engine("fsdp", 2, 2, 1e-6)
    _, fsdp3 = _engine("fsdp", 3, 2, 1e-6)
    assert fsdp2.comm_s == pytest.approx(0.5 * BF16_PSI_S + BF16_PSI_S, rel=1e-6)
    assert fsdp3.comm_s == pytest.approx(fsdp2.comm_s + 0.5 * BF16_PSI_S, rel=1e-6)


def test_ddp_hides_its_all_reduce_behind_the_backward_but_its_last_bucket():
    # fp32 gradients, 4 PSI bytes at bus factor 1: 1.34 ms; the backward is 2/3 of the micro-batch
    all_reduce_s = 2 * BF16_PSI_S
    last_bucket_s = 25 * 2**20 / (BUSBW * 1e9)
    short, _ = _engine("torch_zero", 0, 2, micro_batch_s=1.5e-3)  # a 1 ms backward: 0.34 ms over it
    assert short.comm_s == pytest.approx(all_reduce_s - 1e-3 + last_bucket_s, rel=1e-6)
    long, _ = _engine("torch_zero", 0, 2, micro_batch_s=1.0)
    assert long.comm_s == pytest.approx(last_bucket_s, rel=1e-6)


def test_the_bound_says_communication_where_the_bandwidth_is_tiny():
    slow, _ = _engine("deepspeed", 3, 2, micro_batch_s=5e-3, busbw=0.1)
    assert slow.bound == "communication" and slow.comm_s > 0.5  # 67 MB at 0.1 GB/s
    fast, _ = _engine("deepspeed", 3, 2, micro_batch_s=5e-3, busbw=1000.0)
    assert fast.bound == "compute" and fast.comm_s < 1e-3


def test_hooks_add_host_time_in_proportion_to_their_count():
    # DeepSpeed stage 3: four per module and one per trainable parameter; 1-2: one per parameter
    assert hooks_per_micro_batch(MODEL, "deepspeed", 3, "bf16") == 4 * 30 + 32
    assert hooks_per_micro_batch(MODEL, "deepspeed", 2, "bf16") == 32
    assert hooks_per_micro_batch(MODEL, "deepspeed", 0, "bf16") == 0
    assert hooks_per_micro_batch(MODEL, "fsdp", 3, "bf16") == 4 * (8 + 1)  # each block and the root
    # DDP: 128 MiB of fp32 gradients in 25 MiB buckets, at the boundary only
    assert hooks_per_micro_batch(MODEL, "torch_zero", 0, "bf16", accumulation=2) == 6 / 2

    hook_s = 20e-6
    tiny = 1e-6  # the device's micro-batch: the host sets the step
    step, terms = _engine("deepspeed", 3, 1, tiny, hook_s=hook_s)
    assert terms.hooks == 152 and step.hooks_s == pytest.approx(152 * hook_s)
    assert step.step_s == pytest.approx(152 * hook_s + 1e-3) and step.bound == "host"
    twice = types.SimpleNamespace(**{**vars(MODEL), "modules": 60})
    step2, terms2 = _engine("deepspeed", 3, 1, tiny, hook_s=hook_s, model=twice)
    assert terms2.hooks == 272 and step2.hooks_s == pytest.approx(272 * hook_s)
    unmeasured, _ = _engine("deepspeed", 3, 1, tiny, hook_s=None)  # a profile without the figure
    assert unmeasured.hooks_s == 0 and unmeasured.bound == "compute"
