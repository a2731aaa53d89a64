"""The causes bench/conformance.py found across timm's and Transformers' families (issue 42), one test each,
on tiny modules of the same pattern (docs/conformance.md lists the models):

- floating buffers a module computes with its half-precision weights (timm's Swin adds an fp32 attention
  mask to bf16 scores): each engine, one rank under gloo (tests/rank_group.py), real DeepSpeed and torch;
- an operator without a meta kernel (timm 1.0.29's RegNet calls torch.unique while it builds):
  describe_model counts on a real CPU instance and says so.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

CLASSES, TOKENS, WIDTH = 4, 4, 8


class Table(nn.Module):
    """A rotary-style table: a module of buffers alone, computing in fp32 and casting its result itself."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(WIDTH, dtype=torch.float32) / WIDTH, persistent=False)

    def forward(self, x):
        return torch.cos(self.inv_freq.float()).to(x.dtype)


class MaskedAttention(nn.Module):
    """Swin's pattern: an fp32 additive mask buffer beside the weights it is computed with."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.table = Table()
        mask = torch.zeros(TOKENS, TOKENS).masked_fill(torch.ones(TOKENS, TOKENS).triu(1).bool(), -100.0)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q * self.table(q)) @ k.transpose(-1, -2) + self.mask  # fp32 mask: promoted to fp32
        return self.head((scores.softmax(-1) @ v).mean(1))  # fp32 @ bf16 values: the failure


def masked_spec():
    from ray_zero.models.spec import ModelSpec

    torch.manual_seed(0)

    def make_batch(n, device, generator):
        return (
            torch.randn(n, TOKENS, WIDTH, generator=generator).to(device),
            torch.randint(0, CLASSES, (n,), generator=generator).to(device),
        )

    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).float(), y)

    return ModelSpec(MaskedAttention(), make_batch, loss, None, None)


def train_masked(rank: int, world_size: int, backend: str, stage: int, precision: str) -> dict:
    """On one rank: the buffers' dtypes once the engine is built, and two steps' losses."""
    from ray_zero.models.spec import cast_floating
    from ray_zero.train.engines import build_engine
    from ray_zero.train.settings import EngineSettings

    spec = masked_spec()
    settings = EngineSettings(backend=backend, stage=stage, precision=precision, micro_batch_size=2)
    engine = build_engine(spec, settings, torch.device("cpu"))
    batch = spec.make_batch(2, torch.device("cpu"), torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        losses.append(engine.forward_backward(cast_floating(batch, engine.input_dtype), True).item())
        engine.step()
    dtypes = {"mask": str(spec.module.mask.dtype), "inv_freq": str(spec.module.table.inv_freq.dtype)}
    engine.close()
    return {"losses": losses, **dtypes}


@pytest.mark.parametrize(
    "backend, stage, precision",
    [("deepspeed", 1, "bf16"), ("deepspeed", 3, "bf16"), ("fsdp", 3, "bf16"), ("torch_zero", 1, "bf16")],
)
def test_float_buffers_compute_with_half_precision_weights(ranks, backend, stage, precision):
    """DeepSpeed and FSDP2 cast the mask with the weights (ray_zero/train/precision.py) and leave the
    weightless table's fp32 inv_freq alone; DDP's autocast needs neither (all fp32). Each trains."""
    result = ranks(1).call(train_masked, backend, stage, precision)[0]
    assert all(math.isfinite(loss) for loss in result["losses"]), result
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    assert result["mask"] == ("torch.float32" if backend == "torch_zero" else low), result
    assert result["inv_freq"] == "torch.float32", result


def test_what_to_cast_keeps_norms_and_the_models_fp32_names():
    """Norm statistics stay for FSDP2's fp32 groups; a name in the model's _keep_in_fp32_modules_strict
    (DeepSeek-V3's routing bias) stays fp32; fp32 training casts nothing."""
    from ray_zero.train.precision import buffers_to_cast

    module = nn.Sequential(MaskedAttention(), nn.BatchNorm1d(CLASSES))
    module[0].register_buffer("e_score_correction_bias", torch.zeros(CLASSES))
    module._keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    assert buffers_to_cast(module, torch.bfloat16, keep_norms=True) == ["0.mask"]
    assert set(buffers_to_cast(module, torch.bfloat16, keep_norms=False)) == {
        "0.mask",
        "1.running_mean",
        "1.running_var",
    }
    assert buffers_to_cast(module, torch.float32) == []


class UniqueAtBuild(nn.Module):
    """Builds with torch.unique (no meta kernel), as timm 1.0.29's RegNet does."""

    def __init__(self):
        super().__init__()
        widths = torch.unique(torch.tensor([8, 8, 16])).tolist()
        self.body = nn.Sequential(*(nn.Linear(w, w) for w in widths[:1]), nn.Linear(widths[0], CLASSES))

    def forward(self, x):
        return self.body(x)


class UniqueInForward(nn.Module):
    """Builds on meta; its forward calls torch.unique."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.body(x) * torch.unique(x.sign()).numel()


def unique_at_build() -> nn.Module:
    return UniqueAtBuild()


def unique_in_forward() -> nn.Module:
    return UniqueInForward()


@pytest.mark.parametrize(
    "factory, note",
    [
        ("unique_at_build", "counted on a real CPU instance (aten::_unique2"),
        ("unique_in_forward", "FLOPs and activations counted on a real CPU instance (aten::_unique2"),
    ],
)
def test_an_operator_without_a_meta_kernel_is_counted_on_the_cpu(factory, note, monkeypatch):
    from conftest import ROOT

    from ray_zero.models.describe import describe_model

    monkeypatch.chdir(ROOT)
    info = describe_model(f"tests/test_conformance_causes.py:{factory}", {}, None, [8], CLASSES)
    expected_params = (
        8 * 8 + 8 + 8 * CLASSES + CLASSES if factory == "unique_at_build" else 8 * CLASSES + CLASSES
    )
    assert info.params == expected_params
    assert info.flops_per_sample > 0 and info.saved_bytes_per_sample > 0
    assert note in info.description, info.description
