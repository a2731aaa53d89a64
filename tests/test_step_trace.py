"""The traced step (ray_zero/train/step_trace.py, grid_trace.py, cuda_kernels.py): real models on the meta
device, against the same step traced on real CPU tensors, and the kernels a GPU would pick."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ray_zero.config import Point
from ray_zero.models.describe import build_model_spec
from ray_zero.models.source import ModelSource
from ray_zero.models.spec import ModelSpec
from ray_zero.train.cuda_kernels import attention_kernel, cuda_kernels
from ray_zero.train.grid_trace import Traced, trace_grid, trace_key
from ray_zero.train.step_trace import (
    TraceError,
    build_on_meta,
    module_form,
    prepare,
    trace_step,
)

GPT2 = ModelSource("hf:gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000}, 128)


def _mlp_spec(dropout: float = 0.0) -> ModelSpec:
    module = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(dropout), nn.Linear(256, 10))

    def make_batch(n, device, generator):
        return torch.randn(n, 32, generator=generator).to(device), torch.randint(0, 10, (n,)).to(device)

    return ModelSpec(module, make_batch, lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_the_meta_trace_is_the_same_step_traced_on_real_cpu_tensors():
    # No data-dependent kernel choice in an MLP: meta and the CPU run the same operators, so the tracker
    # must count the same storages on both (what it adds on meta is counting, not arithmetic).
    form = module_form("deepspeed", "fp32")
    on_cpu = trace_step(_mlp_spec(), 64, form, device="cpu")
    spec = _mlp_spec()
    spec.module.to("meta")
    on_meta = trace_step(spec, 64, form)
    assert on_meta.moments == on_cpu.moments and on_meta.forward_bytes == on_cpu.forward_bytes > 0
    # Two Linear weights and biases get gradients (fp32): the tracker finds them among the outputs.
    params = sum(p.numel() for p in spec.module.parameters())
    assert params * 4 <= on_meta.gradient_bytes <= params * 4 + 4 * 512
    # The gelu's input, kept for backward: 64 x 256 fp32, rounded to the allocator's 512-byte blocks.
    assert on_meta.forward_bytes >= 64 * 256 * 4


def test_dropouts_mask_counts_one_byte_an_element_as_cuda_keeps_it():
    form = module_form("deepspeed", "fp32")
    plain, dropped = (_mlp_spec(p) for p in (0.0, 0.1))
    for spec in (plain, dropped):
        spec.module.to("meta")
    extra = trace_step(dropped, 64, form).forward_bytes - trace_step(plain, 64, form).forward_bytes
    # The mask, kept for backward as CUDA's fused kernel keeps it: a bool per element (the composite
    # kernel meta runs makes it in the input's dtype, fp32 here: 4x). Dropout's output replaces the gelu's
    # as what the last Linear keeps.
    assert extra == 64 * 256 * 1


def test_cuda_picks_fused_attention_where_it_can():
    bf16 = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta")
    fp32 = bf16.float()
    mask = torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16, device="meta")
    assert attention_kernel(bf16, bf16, bf16, None) == "flash"
    assert attention_kernel(bf16, bf16, bf16, mask) == "efficient"
    assert attention_kernel(fp32, fp32, fp32, None) == "efficient"
    kv = torch.empty(2, 2, 16, 64, dtype=torch.bfloat16, device="meta")
    assert attention_kernel(bf16, kv, kv, None, enable_gqa=True) == "flash"
    odd = torch.empty(2, 4, 16, 6, dtype=torch.float32, device="meta")
    assert attention_kernel(odd, odd, odd, None) == "math"


def test_a_traced_gpt2_keeps_no_attention_matrix():
    # Flash attention keeps a log-sum-exp per row: the traced step grows about linearly with the
    # sequence, where the math path's attention matrices (seq x seq per head) would grow four-fold.
    def rise(seq_len):
        source = ModelSource(GPT2.model, GPT2.model_config, seq_len)
        spec = build_on_meta(lambda: build_model_spec(source))
        form = module_form("deepspeed", "bf16")
        prepare(spec, form, False)
        traced = trace_step(spec, 2, form)
        assert dict(traced.attention) == {"flash": 2}
        return traced.rise(traced.gradient_bytes) - traced.gradient_bytes

    assert 1.8 < rise(256) / rise(128) < 2.2


def test_autocast_casts_as_cudas_does_on_meta():
    linear, norm = nn.Linear(8, 8, device="meta"), nn.LayerNorm(8, device="meta")
    x = torch.randn(4, 8, device="meta")
    with cuda_kernels(torch.bfloat16) as kernels:
        out = linear(x)
        assert out.dtype == torch.bfloat16  # a matmul runs in the low dtype
        assert norm(out).dtype == torch.float32  # a norm in fp32
        assert F.softmax(out, -1).dtype == torch.float32  # softmax with an fp32 output
        assert linear(x).dtype == torch.bfloat16
        cached = kernels._mode.casts
        assert len(cached) == 2  # the weight and the bias, cast once for the forward
        kernels.end_forward()
        assert not cached
    assert linear(x).dtype == torch.float32  # outside the block: torch as it is


def test_checkpointing_keeps_the_blocks_inputs_only():
    form = module_form("deepspeed", "bf16")
    plain, checkpointed = (build_on_meta(lambda: build_model_spec(GPT2)) for _ in range(2))
    prepare(plain, form, False)
    prepare(checkpointed, form, True)
    kept = trace_step(checkpointed, 4, form, True).forward_bytes
    assert kept < trace_step(plain, 4, form).forward_bytes / 2


def test_a_checkpointed_block_is_recomputed_with_cudas_casts_and_kernels():
    # Autograd runs backward with no torch function mode: each checkpointed block's recompute enters the
    # mode again, so DDP's form (fp32 weights under bf16 autocast) recomputes in bf16 as it ran forward
    # (torch.utils.checkpoint refused a recompute in fp32) and takes the fused attention.
    form = module_form("torch_zero", "bf16")
    plain, checkpointed = (build_on_meta(lambda: build_model_spec(GPT2)) for _ in range(2))
    prepare(plain, form, False)
    prepare(checkpointed, form, True)
    traced = trace_step(checkpointed, 4, form, True)
    assert dict(traced.attention) == {"flash": 4}  # two blocks, each run forward and again in backward
    whole = trace_step(plain, 4, form)
    assert traced.forward_bytes < whole.forward_bytes / 2
    assert traced.rise(traced.gradient_bytes) < whole.rise(whole.gradient_bytes)


def test_a_step_that_reads_its_data_is_not_traced():
    module = nn.Linear(4, 4)

    def loss(model, batch):
        out = model(batch)
        if out.sum().item() > 1e9:  # a value of the data: unknowable on meta
            raise AssertionError
        return out.sum()

    spec = ModelSpec(module, lambda n, d, g: torch.randn(n, 4).to(d), loss)
    spec.module.to("meta")
    with pytest.raises(TraceError, match="reads a value of its data"):
        trace_step(spec, 2, module_form("deepspeed", "fp32"))


def test_a_grid_is_traced_once_per_form_and_lines_between_sizes():
    points = [Point("deepspeed", 1, mb, 1) for mb in (2, 4)] + [Point("fsdp", 3, 2, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traces = trace_grid(GPT2, points, "bf16")
    assert set(traces) == {trace_key("deepspeed", "bf16", False), trace_key("fsdp", "bf16", False)}
    deepspeed = traces[trace_key("deepspeed", "bf16", False)]
    assert isinstance(deepspeed, Traced) and [s.micro_batch for s in deepspeed.steps] == [2, 4, 8]
    # Between traced sizes: on the line through them; at a traced size: its own step.
    assert deepspeed.rise(4, 0) == deepspeed.at(4).rise(0)
    assert deepspeed.rise(2, 0) < deepspeed.rise(3, 0) < deepspeed.rise(4, 0)
    beyond = deepspeed.rise(8, 0) + 8 * deepspeed.per_sample_bytes()
    assert deepspeed.rise(16, 0) == pytest.approx(beyond, rel=1e-9)


def test_a_model_that_cannot_be_traced_says_why_in_one_line(tmp_path):
    factory = tmp_path / "reads_data.py"
    factory.write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = torch.nn.Linear(8, 3)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x[: int(x.abs().sum().item()) % 4 + 1])\n"
        "def build():\n"
        "    return Net()\n"
    )
    source = ModelSource(f"{factory}:build", None, None, [8], 3)
    traces = trace_grid(source, [Point("deepspeed", 1, 2, 1)], "bf16")
    (reason,) = traces.values()
    assert isinstance(reason, str) and "reads a value of its data" in reason and "\n" not in reason


def test_the_step_casts_the_batch_for_the_engine_and_keeps_the_copy():
    # steps.py casts each fp32 micro-batch to the engine's dtype within the step: under DeepSpeed bf16 the
    # copy is the step's (64 x 32 bf16, rounded to 512-byte blocks); in fp32 there is no copy.
    low, full = module_form("deepspeed", "bf16"), module_form("deepspeed", "fp32")
    specs = [_mlp_spec(), _mlp_spec()]
    for spec, form in zip(specs, (low, full)):
        spec.module.to("meta").to(form.params)
    traced_low, traced_full = trace_step(specs[0], 64, low), trace_step(specs[1], 64, full)
    copy = 64 * 32 * 2
    saved_low = traced_low.forward_bytes - copy
    # The low step keeps half of the fp32 one's activations, plus the input's bf16 copy.
    assert abs(saved_low - traced_full.forward_bytes / 2) <= 2 * 512


def test_the_traced_step_carries_its_kernels_flops_as_torchs_flop_counter_counts_them():
    # FlopCounterMode around the trace sees the operators the tracker runs: the recorded FLOPs must be its
    # total, and the matmuls GPT-2's 6 x tokens x (12 d^2 per layer + the tied head's V d), forward+backward.
    from torch.utils.flop_counter import FlopCounterMode

    form = module_form("deepspeed", "bf16")
    spec = build_on_meta(lambda: build_model_spec(GPT2))
    prepare(spec, form, False)
    with FlopCounterMode(display=False) as counter:
        traced = trace_step(spec, 4, form)
    assert traced.flops == counter.get_total_flops() > 0
    kinds = {op.kind for op in traced.ops}
    assert kinds == {"matmul", "attention", "elementwise", "reduction", "random"}  # random: dropout's masks
    tokens, layers, d, vocab = 4 * 128, 2, 64, 1000
    matmul = sum(op.flops for op in traced.ops if op.kind == "matmul")
    assert matmul == 6 * tokens * (layers * 12 * d * d + vocab * d)
    assert all(op.dtype == "bf16" for op in traced.ops if op.kind in ("matmul", "attention"))
    # every bucket's operators moved bytes; launches: each kernel once (views launch none)
    assert all(op.bytes > 0 and op.count > 0 for op in traced.ops)
    assert 50 < sum(op.count for op in traced.ops) < 400
