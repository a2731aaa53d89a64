"""What ray_zero relies on in DeepSpeed beyond `deepspeed.initialize` and the engine's documented methods, in
one place, each found by what the installed DeepSpeed does or has, never by its version string.

* fp16 stage 0's loss scaling (deepspeedai/DeepSpeed#8393): `fp16_loss_scaling` measures, once per process
  and device, what one step of a tiny fp16 stage-0 engine applies per unit of true gradient. DeepSpeed
  0.19.8's `engine.backward` scales the loss for ZeRO optimizers only, while stage 0's fp16 optimizer
  still divides the gradients by its loss scale: updates 1/loss_scale too small (65536 times at the
  default scale), and the loss stops falling. Where the step measures so, ray_zero scales the loss itself,
  and checks that the step then applies the true gradient.
* the CPU communication backend's shared-memory op build (`skip_shm_comm_build`), through DeepSpeed's own
  table of compatible ops.
* its Muon module, which `deepspeed.initialize` imports to check the optimizer's class and which compiles at
  import (`import_muon_uncompiled`), through DeepSpeed's own compile decorator.
* the optimizer classes that `engine.backward` scales the loss for (`zero_optimizer_types`), the engine's
  torch GradScaler (`torch_gradscaler`), and ZeRO-3's module-level references (`release_zero3_module`).

deepspeed is imported inside the functions: importing this module does not import DeepSpeed.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

PROBE_LOSS_SCALE = 1024.0
"""The probe's static loss scale: a power of two, so every product below is exact in fp16."""
PROBE_INPUT = (1.0, 2.0, 3.0, 4.0)
"""The probe's input: its loss sum(w * x) has gradient x, so SGD at lr 1 moves w by exactly -x."""


@dataclass(frozen=True)
class LossScaling:
    """What one fp16 stage-0 step applies per unit of true gradient, as measured on this process."""

    unscaled: float
    """As DeepSpeed does it (1.0: the true gradient; 1/PROBE_LOSS_SCALE: the loss was never scaled)."""
    scaled: Optional[float]
    """With the loss multiplied by the optimizer's loss scale first (measured only where `unscaled` is
    1/PROBE_LOSS_SCALE)."""
    optimizer: str
    """The optimizer wrapper DeepSpeed chose for the probe (e.g. FP16_UnfusedOptimizer)."""

    @property
    def scale_loss(self) -> bool:
        """ray_zero multiplies the loss by the loss scale: the step divides by a scale the loss never got,
        and does apply the true gradient once the loss is scaled."""
        never_scaled = _near(self.unscaled, 1 / PROBE_LOSS_SCALE)
        return never_scaled and self.scaled is not None and _near(self.scaled, 1)

    def said(self, version: str) -> str:
        """What the rank reports (the rank table's loss_scale_fix)."""
        if self.scale_loss:
            return (
                f"applied: DeepSpeed {version}'s fp16 stage-0 step divided the gradients by a loss scale the "
                "loss never got (measured in this process)"
            )
        if _near(self.unscaled, 1):
            return f"not needed: DeepSpeed {version}'s fp16 stage-0 step applied the true gradient (measured)"
        return (
            f"not applied: DeepSpeed {version}'s fp16 stage-0 step applied {self.unscaled:.6g} of the true "
            f"gradient, {self.scaled if self.scaled is not None else 'unmeasured'} with the loss scaled "
            "(deepspeedai/DeepSpeed#8393): if the loss does not fall, that is why"
        )


def _near(value: float, expected: float) -> bool:
    return abs(value - expected) <= 1e-3 * abs(expected)


class _Probe(torch.nn.Module):
    """sum(w * x): elementwise, so the probe starts no matmul library (no cuBLAS workspace) on a GPU."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(len(PROBE_INPUT)))

    def forward(self, x):
        return (self.weight * x).sum()


def fp16_update_ratio(device: torch.device, scale_loss: bool) -> tuple[float, str]:
    """One SGD step (lr 1) of a tiny fp16 stage-0 engine on `device`: the update over the true gradient, and
    the optimizer wrapper DeepSpeed chose. Every rank of the process group must call it together (the
    engine broadcasts its parameters and averages its gradients)."""
    import deepspeed

    if device.type == "cpu":
        skip_shm_comm_build()
    module = _Probe().to(device=device, dtype=torch.float16)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": True, "loss_scale": PROBE_LOSS_SCALE},
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # DeepSpeed's default clips at norm 1
        "steps_per_print": 2**31 - 1,
    }
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    try:
        x = torch.tensor(PROBE_INPUT, dtype=torch.float16, device=device)
        loss = engine(x)
        engine.backward(loss * engine.optimizer.loss_scale if scale_loss else loss)
        engine.step()
        update = -engine.module.weight.detach().float().cpu()
        ratios = update / torch.tensor(PROBE_INPUT)
        return float(ratios.mean()), type(engine.optimizer).__name__
    finally:
        destroy(engine)


@functools.lru_cache(maxsize=None)
def fp16_loss_scaling(device: torch.device) -> LossScaling:
    """fp16 stage 0's loss scaling on this DeepSpeed, measured once per process and device."""
    unscaled, wrapper = fp16_update_ratio(device, scale_loss=False)
    scaled = fp16_update_ratio(device, scale_loss=True)[0] if _near(unscaled, 1 / PROBE_LOSS_SCALE) else None
    return LossScaling(unscaled, scaled, wrapper)


def loss_scale_fix(engine, device: torch.device) -> tuple[bool, Optional[str]]:
    """Whether ray_zero scales `engine`'s loss itself, and what the rank reports of it (None: the engine is
    not concerned: not fp16, a ZeRO optimizer, or a torch GradScaler, each of which engine.backward scales
    for). A concerned engine's optimizer must be the probe's kind, else nothing is applied."""
    import deepspeed

    optimizer = engine.optimizer
    concerned = (
        engine.fp16_enabled()
        and not isinstance(optimizer, zero_optimizer_types())
        and hasattr(optimizer, "loss_scale")
        and not torch_gradscaler(engine)
    )
    if not concerned:
        return False, None
    measured = fp16_loss_scaling(device)
    if measured.optimizer != type(optimizer).__name__:
        reason = (
            f"not applied: the probe's optimizer was {measured.optimizer}, this engine's "
            f"{type(optimizer).__name__}: its loss scaling was not measured"
        )
        warnings.warn(reason, stacklevel=2)
        return False, reason
    said = measured.said(deepspeed.__version__)
    if not measured.scale_loss and not _near(measured.unscaled, 1):
        warnings.warn(said, stacklevel=2)
    return measured.scale_loss, said


def skip_shm_comm_build() -> bool:
    """On CPU, DeepSpeed's communication backend JIT-builds its shared-memory all-reduce at the first
    initialize (deepspeed_shm_comm: 38-62 s of C++ on 2 cores in a fresh environment, 0.3 s once cached).
    Only its tensor-parallel layers call it (`inference_all_reduce`), never ZeRO. Marked incompatible in
    DeepSpeed's own table of compatible ops, as on a machine without a compiler, the backend skips the
    build; training's collectives stay gloo's. Returns whether the table was there to mark."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(compatible, dict):
        return False
    compatible["deepspeed_shm_comm"] = False
    return True


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_uncompiled() -> bool:
    """DeepSpeed's ZeRO and bf16 optimizers import its Muon optimizer in `deepspeed.initialize`, to check
    the optimizer's class; that module wraps its functions in `torch.compile` as it is imported, which
    imports TorchInductor (what that costs a set-up: bench/sweep_waves.md). A ray_zero engine's optimizer
    is torch's Adam(W), never Muon: the module is imported once here with DeepSpeed's compile decorator as
    its own `dummy_decorator` (what DeepSpeed uses where torch has no compile), so its functions stay plain
    Python and nothing compiles. Returns whether it did so."""
    import importlib
    import sys

    from deepspeed.runtime import compiler

    if MUON_MODULE in sys.modules or not hasattr(compiler, "dummy_decorator"):
        return False
    compile_decorator = compiler.compile
    compiler.compile = lambda: compiler.dummy_decorator  # its package's __init__ too, if it imports Muon
    try:
        importlib.import_module(MUON_MODULE)
    except ModuleNotFoundError:  # a DeepSpeed without Muon
        return False
    finally:
        compiler.compile = compile_decorator
    return True


def zero_optimizer_types() -> tuple[type, ...]:
    """The optimizer base classes engine.backward scales the loss for (none where DeepSpeed has no such
    base class: then every fp16 stage-0 engine is probed)."""
    try:
        from deepspeed.runtime.base_optimizer import ZeROOptimizer
    except ImportError:
        return ()
    return (ZeROOptimizer,)


def torch_gradscaler(engine):
    """The torch GradScaler the engine scales the loss with (its torch_autocast mode at stage 0), or None."""
    return getattr(engine, "torch_autocast_z0_gradscaler", None)


def destroy(engine) -> None:
    """The engine's own teardown (its ZeRO optimizers hook every parameter's gradient accumulator, a
    reference cycle through C++ the garbage collector cannot see), where the engine has one."""
    teardown = getattr(engine, "destroy", None)
    if callable(teardown):
        teardown()


def release_zero3_module(module: torch.nn.Module) -> None:
    """What ZeRO-3 keeps of a finished engine's module after destroy(): the module on a module-level stack
    (where DeepSpeed has it), each parameter's references to the optimizer (`_z3_optimizer`) and its
    partition (`ds_tensor`), and the hooks it registered, which close over its engine."""
    try:
        from deepspeed.runtime.zero import parameter_offload
    except ImportError:
        parameter_offload = None
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    for param in module.parameters():
        vars(param).clear()
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    for submodule in module.modules():
        for name, hooks in vars(submodule).items():
            if "hooks" in name and isinstance(hooks, dict):
                hooks.clear()
