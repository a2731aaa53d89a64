"""ray_zero/train/ds_compat.py at rank level: real DeepSpeed under gloo, two CPU ranks, no Ray.

fp16 needs a GPU in DeepSpeed's eyes: its CPU accelerator says fp16 is unsupported where oneDNN has no
fp16 kernels (this machine), and `deepspeed.initialize` refuses it. `fp16_on_this_cpu` lifts that one flag
in the rank's process for the test's span, so that DeepSpeed's own fp16 engine, loss-scaling optimizer and
step run on the CPU (torch computes fp16 on the CPU); nothing of the probe or of DeepSpeed's step is
replaced. The same probe runs unmodified on a GPU (bench/compat.md says where it was checked).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from test_engines import toy_spec

from ray_zero.train import ds_compat
from ray_zero.train.engines import build_engine
from ray_zero.train.settings import EngineSettings


@contextlib.contextmanager
def fp16_on_this_cpu():
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    saved = accelerator.is_fp16_supported
    accelerator.is_fp16_supported = lambda self: True
    try:
        yield
    finally:
        accelerator.is_fp16_supported = saved


def measure_loss_scaling(rank: int, world_size: int):
    import deepspeed

    with fp16_on_this_cpu():
        # Not the per-process cache: each call measures afresh.
        return ds_compat.fp16_loss_scaling.__wrapped__(torch.device("cpu")), deepspeed.__version__


def engine_reports(rank: int, world_size: int) -> dict[str, object]:
    """What ray_zero's DeepSpeed engine says of its loss scaling, per precision and stage, and the loss of
    four fp16 stage-0 steps on one repeated batch."""
    said = {}
    with fp16_on_this_cpu():
        for precision, stage in (("fp16", 0), ("fp16", 1), ("fp32", 0)):
            settings = EngineSettings(stage=stage, precision=precision, micro_batch_size=4, world_size=2)
            engine = build_engine(toy_spec(), settings, torch.device("cpu"))
            said[f"{precision}-{stage}"] = engine.loss_scale_fix
            if (precision, stage) == ("fp16", 0):
                batch = engine.spec.make_batch(4, "cpu", torch.Generator().manual_seed(rank))
                batch = (batch[0].to(engine.input_dtype), batch[1])
                losses = []
                for _ in range(4):
                    losses.append(float(engine.forward_backward(batch, boundary=True)))
                    engine.step()
                said["losses"] = losses
            engine.close()
    return said


@pytest.fixture(scope="module")
def measured(ranks):
    return ranks(2).call(measure_loss_scaling)


def test_the_fp16_stage0_step_applies_the_true_gradient_once_the_decision_is_applied(measured):
    """One SGD step at lr 1 of sum(w * x): the update is exactly -x when the loss is scaled as DeepSpeed's
    step expects. Without the decision (the loss left as it is) DeepSpeed 0.19.8 applies 1/1024 of it."""
    for scaling, version in measured:
        applied = scaling.scaled if scaling.scale_loss else scaling.unscaled
        assert applied == pytest.approx(1.0, rel=1e-3), (scaling, version)
        if version == "0.19.8":  # where the bug was found on an H200: the probe must see it
            assert scaling.scale_loss and scaling.unscaled == pytest.approx(1 / ds_compat.PROBE_LOSS_SCALE)
    assert measured[0] == measured[1]  # both ranks stepped the same engine


def test_the_engine_reports_the_measured_decision_only_where_it_is_concerned(ranks, measured):
    import deepspeed

    reports = ranks(2).call(engine_reports)
    scaling = measured[0][0]
    for said in reports:
        assert said["fp16-0"] == scaling.said(deepspeed.__version__)
        assert said["fp16-0"].startswith("applied" if scaling.scale_loss else "not needed")
        assert said["fp16-1"] is None and said["fp32-0"] is None  # a ZeRO optimizer; no loss scale
        assert said["losses"][-1] < said["losses"][0]


def shm_comm_skipped(rank: int, world_size: int) -> tuple[bool, object]:
    import deepspeed.ops

    return ds_compat.skip_shm_comm_build(), deepspeed.ops.__compatible_ops__.get("deepspeed_shm_comm")


def test_the_cpu_shared_memory_op_is_marked_incompatible_in_deepspeeds_own_table(ranks):
    assert ranks(1).call(shm_comm_skipped) == [(True, False)]


MUON_CHECK = """
import sys
from ray_zero.train import ds_compat
from deepspeed.runtime import compiler
import torch
first = ds_compat.import_muon_uncompiled()
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # what initialize imports
from deepspeed.runtime.zero.muon import original_muon
print(first, ds_compat.import_muon_uncompiled(), compiler.compile() is torch.compile,
      hasattr(original_muon.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable"),
      "torch._inductor.compile_fx" in sys.modules)
"""


def test_deepspeeds_muon_module_is_imported_uncompiled_and_inductor_never_loads():
    """`deepspeed.initialize` imports DeepSpeed's Muon module (its class is checked against the
    optimizer); imported by ds_compat first, its functions stay uncompiled, DeepSpeed's decorator is
    itself again, and TorchInductor is not imported. A fresh process: this one may hold Inductor already."""
    done = subprocess.run(
        [sys.executable, "-c", MUON_CHECK], capture_output=True, text=True, cwd=ROOT, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported, again, restored, compiled, inductor = done.stdout.split()[-5:]
    assert (imported, again, restored) == ("True", "False", "True")
    assert (compiled, inductor) == ("False", "False")
