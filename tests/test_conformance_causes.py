"""The causes bench/conformance.py found across timm's and Transformers' families (issue 42), one test each,
on tiny modules of the same pattern (docs/conformance.md lists the models):

- floating buffers a module computes with its half-precision weights (timm's Swin adds an fp32 attention
  mask to bf16 scores; TResNet's BlurPool convolves with an fp32 kernel): each engine, one rank under
  gloo (tests/rank_group.py), real DeepSpeed and torch;
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


class Blur(nn.Module):
    """timm's BlurPool pattern: a module of buffers alone applying its fp32 kernel with F.conv1d."""

    def __init__(self):
        super().__init__()
        self.register_buffer("kernel", torch.full((WIDTH, 1, 1), 1.0), persistent=False)

    def forward(self, x):
        return nn.functional.conv1d(x.transpose(1, 2), self.kernel, groups=WIDTH).transpose(1, 2)


class MaskedAttention(nn.Module):
    """Swin's pattern: an fp32 additive mask buffer beside the weights it is computed with."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.table = Table()
        self.blur = Blur()
        mask = torch.zeros(TOKENS, TOKENS).masked_fill(torch.ones(TOKENS, TOKENS).triu(1).bool(), -100.0)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(self.blur(x)).chunk(3, dim=-1)
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


def _two_steps(spec, backend: str, stage: int, precision: str):
    """The engine built for `spec` on this rank, and the losses of two steps on one batch."""
    from ray_zero.models.spec import cast_floating
    from ray_zero.train.engines import build_engine
    from ray_zero.train.settings import EngineSettings

    settings = EngineSettings(backend=backend, stage=stage, precision=precision, micro_batch_size=2)
    engine = build_engine(spec, settings, torch.device("cpu"))
    batch = spec.make_batch(2, torch.device("cpu"), torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        losses.append(engine.forward_backward(cast_floating(batch, engine.input_dtype), True).item())
        engine.step()
    return engine, losses


def train_masked(rank: int, world_size: int, backend: str, stage: int, precision: str) -> dict:
    """On one rank: the buffers' dtypes once the engine is built, and two steps' losses."""

    spec = masked_spec()
    engine, losses = _two_steps(spec, backend, stage, precision)
    module = spec.module
    dtypes = {
        "mask": str(module.mask.dtype),
        "kernel": str(module.blur.kernel.dtype),
        "inv_freq": str(module.table.inv_freq.dtype),
    }
    engine.close()
    return {"losses": losses, **dtypes}


@pytest.mark.parametrize(
    "backend, stage, precision",
    [("deepspeed", 1, "bf16"), ("deepspeed", 3, "bf16"), ("fsdp", 3, "bf16"), ("torch_zero", 1, "bf16")],
)
def test_float_buffers_compute_with_half_precision_weights(ranks, backend, stage, precision):
    """DeepSpeed and FSDP2 cast the mask with the weights and the weightless blur's kernel
    (ray_zero/train/precision.py), and leave the weightless table's fp32 inv_freq alone; DDP's autocast
    needs neither (all fp32). Each trains."""
    result = ranks(1).call(train_masked, backend, stage, precision)[0]
    assert all(math.isfinite(loss) for loss in result["losses"]), result
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    assert result["mask"] == ("torch.float32" if backend == "torch_zero" else low), result
    assert result["kernel"] == result["mask"], result
    assert result["inv_freq"] == "torch.float32", result


def test_what_to_cast_keeps_norms_and_the_models_fp32_names():
    """Norm statistics stay for FSDP2's fp32 groups; a name in the model's _keep_in_fp32_modules_strict
    (DeepSeek-V3's routing bias) stays fp32; fp32 training casts nothing."""
    from ray_zero.train.precision import buffers_to_cast

    module = nn.Sequential(MaskedAttention(), nn.BatchNorm1d(CLASSES))
    module[0].register_buffer("e_score_correction_bias", torch.zeros(CLASSES))
    module._keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    assert buffers_to_cast(module, torch.bfloat16, keep_norms=True) == ["0.mask", "0.blur.kernel"]
    assert set(buffers_to_cast(module, torch.bfloat16, keep_norms=False)) == {
        "0.mask",
        "0.blur.kernel",
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


class RefusedDtypeOnMeta(nn.Module):
    """A torch release's meta function refusing a dtype (torch 2.11 on a timm family: "unsupported
    scalarType"), where a real device runs it; `extra` parameters make it too large to count on the CPU."""

    def __init__(self, extra: int = 0, everywhere: bool = False):
        super().__init__()
        self.body = nn.Linear(8, CLASSES)
        self.extra = nn.Parameter(torch.zeros(extra)) if extra else None
        self.everywhere = everywhere

    def forward(self, x):
        if x.is_meta or self.everywhere:
            raise RuntimeError("unsupported scalarType")
        return self.body(x)


def refused_dtype_small() -> nn.Module:
    return RefusedDtypeOnMeta()


def refused_dtype_large() -> nn.Module:
    return RefusedDtypeOnMeta(extra=600_000_000)  # 2.2 GiB of fp32: above REAL_COUNT_LIMIT_BYTES


def refused_everywhere() -> nn.Module:
    return RefusedDtypeOnMeta(everywhere=True)


def test_a_kernel_error_on_meta_is_counted_on_the_cpu_or_left_to_calibration_not_refused(monkeypatch):
    # Issue 65 item 5: a count that fails on meta under the running torch is not a reason to refuse.
    from conftest import ROOT

    from ray_zero.models.describe import describe_model
    from ray_zero.models.source import ModelError

    monkeypatch.chdir(ROOT)
    path = "tests/test_conformance_causes.py"
    small = describe_model(f"{path}:refused_dtype_small", {}, None, [8], CLASSES)
    reason = "(RuntimeError: unsupported scalarType on meta"
    assert small.flops_per_sample > 0 and f"counted on a real CPU instance {reason})" in small.description
    with torch.device("meta"):  # built on meta by describe_model: no 2.2 GiB held here
        large = describe_model(f"{path}:refused_dtype_large", {}, None, [8], CLASSES)
    assert large.params > 600_000_000 and large.flops_per_sample == 0.0
    assert f"FLOPs and activations not counted {reason}" in large.description
    # An error the CPU raises too is the model's: refused in one line.
    with pytest.raises(ModelError, match="failed on the cpu device: .*unsupported scalarType"):
        describe_model(f"{path}:refused_everywhere", {}, None, [8], CLASSES)


class SharedBlock(nn.Module):
    """CoaT's pattern: blocks that hold one module in common beside their own weights."""

    def __init__(self, shared: nn.Module):
        super().__init__()
        self.shared, self.own = shared, nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.own(self.shared(x))


def train_shared(rank: int, world_size: int) -> list[float]:
    """FSDP2 at stage 3, bf16, over two blocks sharing a Linear: two steps' losses."""
    from ray_zero.models.spec import ModelSpec

    torch.manual_seed(0)
    shared = nn.Linear(WIDTH, WIDTH)
    blocks = [SharedBlock(shared), SharedBlock(shared)]
    module = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(WIDTH * TOKENS, CLASSES))
    template = masked_spec()
    spec = ModelSpec(module, template.make_batch, template.loss, blocks, None)
    engine, losses = _two_steps(spec, "fsdp", 3, "bf16")
    engine.close()
    return losses


def test_a_module_shared_by_blocks_trains_on_fsdp2(ranks):
    """The second block's shared parameters are already sharded by the first block's group: it stays in
    the root's group (ray_zero/train/torch_engines.py) instead of failing in fully_shard."""
    losses = ranks(1).call(train_shared)[0]
    assert all(math.isfinite(loss) for loss in losses), losses


class Pooled(nn.Module):
    """BigBird's pattern: a pooler the loss does not reach (the masked-LM head reads the tokens)."""

    def __init__(self):
        super().__init__()
        self.body, self.pooler, self.head = (
            nn.Linear(WIDTH, WIDTH),
            nn.Linear(WIDTH, 6),
            nn.Linear(WIDTH, CLASSES),
        )

    def forward(self, x):
        return self.head(self.body(x).mean(1))


def unreached_model() -> nn.Module:
    return Pooled()


@pytest.mark.parametrize("backend, stage", [("deepspeed", 1), ("fsdp", 3), ("torch_zero", 1)])
def test_parameters_the_loss_does_not_reach_are_predicted(ranks, monkeypatch, backend, stage):
    """The counting backward finds the pooler unreached (ModelInfo.unreached_params); DeepSpeed ZeRO-1
    holds a zero gradient for it beside its buffer, FSDP2 no gradient and no Adam states: each to the byte
    (Adam's step counters aside, as tests/test_zoo.py allows)."""
    from conftest import ROOT
    from rank_group import experiment_of, trial_spec

    from ray_zero.config import Point
    from ray_zero.measure.memory_model import predict_point

    monkeypatch.chdir(ROOT)
    experiment = experiment_of(
        "experiments/tiny_models_cpu.yaml",
        "model=tests/test_conformance_causes.py:unreached_model",
        "model_config={}",
        "seq_len=null",
        f"input_shape=[{TOKENS},{WIDTH}]",
        f"num_classes={CLASSES}",
        "precision=bf16",
        "steps=2",
        "warmup_steps=1",
    )
    spec = trial_spec(experiment, Point(backend, stage, 2, 1))
    assert spec.model.unreached_params == (2, 3)  # the pooler's weight and bias
    row = ranks(1).row(spec)
    assert row["status"] == "ok", row["error"]
    predicted = predict_point(row)
    for state in ("parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes"):
        measured, expected = row[f"{state}_per_rank_max"], getattr(predicted, state)
        slack = 4 * 6 + 4 if state == "optimizer_state_bytes" else 0
        assert expected <= measured <= expected + slack, (state, measured, expected)
