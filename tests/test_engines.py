"""The three engines for real: torch.distributed over gloo with 1 and 2 CPU processes, no Ray, no mocks.

The harness's groups of 1 and 2 ranks (tests/rank_group.py) run every case in sequence and return what
each rank measured; the tests below read those numbers. The toy model's eight 32x128 weight matrices carry 95
% of its
parameters, so ZeroRedundancyOptimizer, which gives whole tensors to ranks, can split it nearly evenly.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from ray_zero.config import unsupported
from ray_zero.models.spec import ModelSpec
from ray_zero.train.engine_base import EngineError
from ray_zero.train.engines import build_engine
from ray_zero.train.settings import EngineSettings

WIDTH, BLOCKS, CLASSES, STEPS = 32, 4, 10, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def toy_spec() -> ModelSpec:
    torch.manual_seed(0)
    module = Toy()

    def make_batch(n, device, generator):
        return (
            torch.randn(n, 8, 16, generator=generator).to(device),
            torch.randint(0, CLASSES, (n,), generator=generator).to(device),
        )

    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).float(), y)

    return ModelSpec(module=module, make_batch=make_batch, loss=loss, blocks=list(module.blocks))


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd saves for backward, each storage once, parameters left out: also the gathered ones
    (FSDP2's unsharded, ZeRO-3's), which are Parameters with storages of their own, freed after forward."""

    def __init__(self, module):
        from torch.distributed.tensor import (
            DTensor,  # FSDP2's parameters: only their local shard has a storage
        )

        parameters = {
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
            for p in module.parameters()
        }
        seen, self.bytes = set(), 0

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen and ptr not in parameters and not isinstance(t, nn.Parameter):
                seen.add(ptr)
                self.bytes += t.untyped_storage().nbytes()
            return t

        super().__init__(pack, lambda t: t)


def full_gradients(engine, module):
    """Every parameter's whole gradient after backward, before the step (names as in the module)."""
    grads = {}
    for name, p in module.named_parameters():
        if engine.backend == "deepspeed":
            from deepspeed.utils import safe_get_full_grad

            grad = safe_get_full_grad(p)
        else:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().float().clone()
    return grads


def run_case(case: dict, rank: int, world_size: int) -> dict:
    spec = toy_spec()
    settings = EngineSettings(
        backend=case["backend"],
        stage=case["stage"],
        precision=case.get("precision", "fp32"),
        micro_batch_size=4,
        gradient_accumulation_steps=case.get("accumulation", 1),
        world_size=world_size,
        offload_optimizer=case.get("offload", "none"),
        activation_checkpointing=case.get("checkpointing", False),
    )
    engine = build_engine(spec, settings, torch.device("cpu"))
    batch = spec.make_batch(4, torch.device("cpu"), torch.Generator().manual_seed(100 + rank))
    batch = (batch[0].to(engine.input_dtype), batch[1])
    result = {"losses": [], "config": engine.config}
    if engine.backend == "deepspeed":
        result["config_deepspeed_got"] = copy.deepcopy(engine.engine.config)
    for step in range(STEPS):
        for micro in range(settings.gradient_accumulation_steps):
            boundary = micro == settings.gradient_accumulation_steps - 1
            saved = SavedBytes(spec.module) if step == 0 and micro == 0 else None
            # A context manager at 1 rank, a callable that returns one at 2 (as the worker passes its probe).
            context = saved if world_size == 1 or saved is None else (lambda: saved)
            loss = engine.forward_backward(batch, boundary, forward_context=context)
            if saved is not None:
                result["saved_bytes"] = saved.bytes
        if step == 0 and case.get("gradients"):
            result["gradients"] = full_gradients(engine, spec.module)
        engine.step()
        if step == 0:
            result["states"] = engine.model_state_bytes()
        result["losses"].append(loss.item())
    return result


def case_name(case: dict) -> str:
    return "-".join(str(case[k]) for k in ("backend", "stage")) + "".join(
        f"-{k}={case[k]}" for k in ("precision", "offload", "checkpointing", "accumulation") if k in case
    )


def run_cases(rank: int, world_size: int, cases: list[dict]) -> dict:
    """On every rank of a harness group: each case in turn, {case name: measurements or its error}."""
    results = {}
    for case in cases:
        try:
            results[case_name(case)] = run_case(case, rank, world_size)
        except Exception as error:  # kept as the row would show it; the test says which case failed
            results[case_name(case)] = {"error": f"{type(error).__name__}: {error}"}
    return results


SUPPORTED = [("deepspeed", s) for s in (0, 1, 2, 3)] + [
    ("torch_zero", 0),
    ("torch_zero", 1),
    ("fsdp", 2),
    ("fsdp", 3),
]
BASIC = [{"backend": b, "stage": s} for b, s in SUPPORTED]
ONE_RANK = (
    BASIC
    + [
        {"backend": b, "stage": s, "checkpointing": c, "gradients": True}
        for b, s in (("torch_zero", 0), ("fsdp", 3), ("deepspeed", 0), ("deepspeed", 3))
        for c in (False, True)
    ]
    + [{"backend": "deepspeed", "stage": 1, "precision": "fp16"}]
)
TWO_RANKS = BASIC + [
    {"backend": "torch_zero", "stage": 1, "precision": "bf16"},
    {"backend": "fsdp", "stage": 2, "precision": "bf16"},
    {"backend": "deepspeed", "stage": 2, "precision": "bf16"},
    {"backend": "deepspeed", "stage": 1, "offload": "cpu"},
    {"backend": "deepspeed", "stage": 2, "offload": "cpu"},
    {"backend": "deepspeed", "stage": 2, "accumulation": 2},
    {"backend": "torch_zero", "stage": 1, "accumulation": 2},
    {"backend": "fsdp", "stage": 3, "accumulation": 2},
]


@pytest.fixture(scope="module")
def runs(ranks):
    """{world_size: [rank 0's results, ...]}, each results {case name: measurements}: the 1-rank and the
    2-rank groups work at the same time (three processes on two cores)."""
    for world_size, cases in ((1, ONE_RANK), (2, TWO_RANKS)):
        ranks(world_size).submit(run_cases, cases)
    return {world_size: ranks(world_size).results(timeout=600) for world_size in (1, 2)}


def result(runs, world_size, rank, **case):
    measured = runs[world_size][rank][case_name(case)]
    assert "error" not in measured, f"{case_name(case)} at {world_size} ranks: {measured['error']}"
    return measured


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("backend,stage", SUPPORTED)
def test_loss_falls(runs, world_size, backend, stage):
    for rank in range(world_size):
        losses = result(runs, world_size, rank, backend=backend, stage=stage)["losses"]
        assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_engine_steps_the_same_optimizer(runs, world_size):
    """fp32, same seed and data: the same losses from every engine (DeepSpeed's default clipping is off)."""
    reference = result(runs, world_size, 0, backend="torch_zero", stage=0)["losses"]
    for backend, stage in SUPPORTED:
        assert result(runs, world_size, 0, backend=backend, stage=stage)["losses"] == pytest.approx(
            reference, rel=1e-5
        ), (backend, stage)


def test_forward_context_sees_every_engines_forward(runs):
    """The same activations from each engine's forward (gathered parameters are not activations)."""
    saved = {
        (w, b, s): result(runs, w, 0, backend=b, stage=s)["saved_bytes"] for w in (1, 2) for b, s in SUPPORTED
    }
    assert len(set(saved.values())) == 1 and min(saved.values()) > 0, saved


def optimizer_states(runs, world_size, **case):
    return [result(runs, world_size, r, **case)["states"]["optimizer_state_bytes"] for r in range(world_size)]


@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp_shards_optimizer_states(runs, stage):
    (whole,), halves = (
        optimizer_states(runs, 1, backend="fsdp", stage=stage),
        optimizer_states(runs, 2, backend="fsdp", stage=stage),
    )
    step_counters = 4 * len(list(Toy().parameters()))  # AdamW's per-tensor step: every rank keeps one of each
    assert sum(halves) == whole + step_counters, (halves, whole)
    assert max(halves) <= 0.51 * whole, (halves, whole)
    parameters = [
        result(runs, 2, r, backend="fsdp", stage=stage)["states"]["parameter_bytes"] for r in range(2)
    ]
    assert (
        max(parameters) <= 0.51 * result(runs, 1, 0, backend="fsdp", stage=stage)["states"]["parameter_bytes"]
    )


def test_zero_redundancy_optimizer_splits_whole_tensors(runs):
    (whole,), parts = (
        optimizer_states(runs, 1, backend="torch_zero", stage=1),
        optimizer_states(runs, 2, backend="torch_zero", stage=1),
    )
    assert sum(parts) == whole, (parts, whole)  # each parameter's states on exactly one rank
    assert max(parts) <= 0.60 * whole, (parts, whole)
    assert optimizer_states(runs, 2, backend="torch_zero", stage=0) == [whole, whole]  # plain DDP: no split


def test_deepspeed_stage1_halves_optimizer_states(runs):
    stage0, stage1 = (
        optimizer_states(runs, 2, backend="deepspeed", stage=0),
        optimizer_states(runs, 2, backend="deepspeed", stage=1),
    )
    for rank in range(2):
        assert stage1[rank] == pytest.approx(stage0[rank] / 2, rel=0.01), (stage0, stage1)


@pytest.mark.parametrize(
    "backend,stage", [("torch_zero", 0), ("fsdp", 3), ("deepspeed", 0), ("deepspeed", 3)]
)
def test_activation_checkpointing_same_gradients_fewer_saved_bytes(runs, backend, stage):
    plain = result(runs, 1, 0, backend=backend, stage=stage, checkpointing=False, gradients=True)
    checkpointed = result(runs, 1, 0, backend=backend, stage=stage, checkpointing=True, gradients=True)
    torch.testing.assert_close(checkpointed["gradients"], plain["gradients"])
    assert checkpointed["saved_bytes"] < 0.5 * plain["saved_bytes"], (
        checkpointed["saved_bytes"],
        plain["saved_bytes"],
    )


@pytest.mark.parametrize("backend,stage", [("torch_zero", 1), ("fsdp", 2), ("deepspeed", 2)])
def test_bf16_on_cpu(runs, backend, stage):
    for rank in range(2):
        losses = result(runs, 2, rank, backend=backend, stage=stage, precision="bf16")["losses"]
        assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_offload_trains_like_no_offload(runs, stage):
    """ZeRO-Offload on this CPU machine: DeepSpeed steps torch's AdamW on host partitions; same numbers."""
    offloaded = result(runs, 2, 0, backend="deepspeed", stage=stage, offload="cpu")
    plain = result(runs, 2, 0, backend="deepspeed", stage=stage)
    assert offloaded["config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offloaded["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert offloaded["states"]["optimizer_state_bytes"] == plain["states"]["optimizer_state_bytes"]


@pytest.mark.parametrize("backend,stage", [("deepspeed", 2), ("torch_zero", 1), ("fsdp", 3)])
def test_gradient_accumulation_of_one_repeated_batch_is_one_batch(runs, backend, stage):
    """Two micro-batches of the same batch, each scaled by 1/2, step like that batch alone."""
    for rank in range(2):
        accumulated = result(runs, 2, rank, backend=backend, stage=stage, accumulation=2)["losses"]
        assert accumulated == pytest.approx(
            result(runs, 2, rank, backend=backend, stage=stage)["losses"], rel=1e-5
        )


def test_deepspeed_fp16_on_cpu_trains_where_its_accelerator_has_fp16_else_says_why(runs):
    from deepspeed.accelerator import get_accelerator

    measured = runs[1][0]["deepspeed-1-precision=fp16"]
    if get_accelerator().is_fp16_supported():  # oneDNN has fp16 on this CPU (AVX512-FP16, AMX)
        assert "error" not in measured and measured["losses"][-1] < measured["losses"][0], measured
    else:
        assert measured == {"error": "ValueError: Type fp16 is not supported on your device."}


def deepspeed_builds_its_inference_all_reduce(rank: int, world_size: int) -> bool:
    from deepspeed.comm import comm

    return comm.cdb.shm_comm_op is not None


def test_deepspeed_on_cpu_skips_building_its_inference_all_reduce(runs, ranks):
    """The ranks of `runs` initialized DeepSpeed on CPU: its shared-memory all-reduce (a JIT build of 38-62 s
    in a fresh environment, used by tensor-parallel layers only) was not built, and every case trained."""
    assert ranks(2).call(deepspeed_builds_its_inference_all_reduce) == [False, False]


def test_deepspeed_config_is_what_initialize_got(runs):
    measured = result(runs, 2, 0, backend="deepspeed", stage=2)
    config = measured["config"]
    assert config == measured["config_deepspeed_got"]  # key for key, after training
    assert config["zero_optimization"]["stage"] == 2 and config["optimizer"]["params"]["torch_adam"] is True
    assert config["gradient_clipping"] == 0.0
    assert config["train_batch_size"] == 4 * 2


@pytest.mark.parametrize(
    "backend,stage,offload,reason",
    [
        ("torch_zero", 2, "none", "torch_zero has stages 0, 1, not 2"),
        ("torch_zero", 3, "none", "torch_zero has stages 0, 1, not 3"),
        ("fsdp", 0, "none", "fsdp has stages 2, 3, not 0"),
        ("fsdp", 1, "none", "fsdp has stages 2, 3, not 1"),
        ("deepspeed", 0, "cpu", "offload_optimizer needs backend deepspeed with stage 1, 2 or 3"),
        ("torch_zero", 1, "cpu", "offload_optimizer needs backend deepspeed with stage 1, 2 or 3"),
        ("fsdp", 3, "cpu", "offload_optimizer needs backend deepspeed with stage 1, 2 or 3"),
        ("megatron", 1, "none", "backend must be one of deepspeed, torch_zero, fsdp, not 'megatron'"),
    ],
)
def test_unsupported_combinations(backend, stage, offload, reason):
    assert unsupported(backend, stage, offload) == reason
    with pytest.raises(EngineError, match=f"^{re.escape(reason)}$"):
        build_engine(
            toy_spec(),
            EngineSettings(backend=backend, stage=stage, offload_optimizer=offload),
            torch.device("cpu"),
        )


def test_supported_combinations():
    assert all(unsupported(b, s) is None for b, s in SUPPORTED)
    assert unsupported("deepspeed", 3, "cpu") is None


def test_a_model_without_blocks_cannot_be_checkpointed():
    spec = toy_spec()
    spec.blocks = None
    with pytest.raises(EngineError, match="^this model cannot be checkpointed"):
        build_engine(
            spec, EngineSettings(backend="torch_zero", activation_checkpointing=True), torch.device("cpu")
        )
