"""Fine-tuning a built model: LoRA adapters through the PEFT library, and parameters frozen by name.

`apply_finetune(module, finetune, source)` changes the module in place, as the experiment's `finetune:`
section says, where every model source is built (models/describe.py: on the meta device to describe and
trace it, on the CPU for a rank). LoRA first (peft's `inject_adapter_in_model`: the module keeps its
class, forward and blocks, its targeted layers wrapped; every other parameter frozen), then the `freeze`
patterns (fnmatch over `named_parameters()`, tied names included) set requires_grad=False on what they
match. What the engines do with frozen parameters follows from requires_grad alone. Bad input (a target
or a pattern that matches nothing, peft missing, nothing left to train) is one ModelError line. torch
and peft only: no Ray, no DeepSpeed.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional, Union

from torch import nn

from ray_zero.models.source import ModelError

EXTRA = "pip install 'ray_zero[finetune]'"
"""How to get PEFT (pyproject.toml's optional extra)."""


@dataclass(frozen=True)
class LoraSpec:
    """peft.LoraConfig's fields that ray_zero passes on (the experiment's finetune.lora)."""

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: Union[tuple[str, ...], str, None] = None
    """Module names (a name or its last dotted parts), a regex string, "all-linear", or None: peft's
    default for the Transformers architecture."""
    bias: str = "none"


@dataclass(frozen=True)
class FineTuneSpec:
    """The experiment's finetune section as the model code takes it: plain, hashable data."""

    lora: Optional[LoraSpec] = None
    freeze: tuple[str, ...] = ()


def apply_finetune(module: nn.Module, finetune: Optional[FineTuneSpec], source: str) -> None:
    """LoRA, then the freeze patterns, on `module` in place (a no-op for None)."""
    if finetune is None:
        return
    if finetune.lora is not None:
        _inject_lora(module, finetune.lora, source)
    if finetune.freeze:
        _freeze(module, finetune.freeze, source)
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelError(f"finetune leaves no parameter of {source} to train (see finetune.freeze)")


def _inject_lora(module: nn.Module, lora: LoraSpec, source: str) -> None:
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.tuners_utils import check_target_module_exists
    except ImportError:
        raise ModelError(f"finetune.lora needs the PEFT library, not installed here: {EXTRA}") from None
    targets = lora.target_modules
    names = [name for name, _ in module.named_modules() if name]
    if isinstance(targets, tuple):
        # peft's own rule (a name, or its last dotted parts), each target on its own: one that matches
        # nothing is a typo peft would pass over while another target matches.
        missing = [
            target
            for target in targets
            if not any(check_target_module_exists(LoraConfig(target_modules=[target]), n) for n in names)
        ]
        if missing:
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules() if _adaptable(m)})
            raise ModelError(
                f"finetune.lora.target_modules {missing} match no module of {source} (its linear, "
                f"convolution and embedding layers: {', '.join(leaves[:12])})"
            )
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=list(targets) if isinstance(targets, tuple) else targets,
        bias=lora.bias,
    )
    try:
        inject_adapter_in_model(config, module)
    except (ValueError, TypeError) as error:  # peft's refusals: a target of a type it cannot adapt, ...
        text = " ".join(str(error).split())[:300]
        raise ModelError(f"finetune.lora on {source}: {type(error).__name__}: {text}") from None


def _adaptable(module: nn.Module) -> bool:
    """A layer LoRA can wrap (by its type's name: Transformers' Conv1D too)."""
    return next(module.children(), None) is None and type(module).__name__ in {
        "Linear", "Conv1D", "Conv1d", "Conv2d", "Conv3d", "Embedding"
    }  # fmt: skip


def _freeze(module: nn.Module, patterns: tuple[str, ...], source: str) -> None:
    # remove_duplicate=False: a tied weight answers to each of its names (lm_head.weight and the embedding's).
    named = list(module.named_parameters(remove_duplicate=False))
    for pattern in patterns:
        matched = [p for name, p in named if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            examples = ", ".join(repr(name) for name, _ in named[:3])
            raise ModelError(
                f"finetune.freeze {pattern!r} matches no parameter of {source} (a pattern matches whole "
                f"names, as named_parameters() gives them: {examples}, ...)"
            )
        for parameter in matched:
            parameter.requires_grad_(False)
