"""What every model source (presets, hf:, timm:, factories) shares: the one-line ModelError, what a source
returns (`Built`), the classifier ModelSpec, the repeated blocks and their checkpointing, and the helpers
that turn bad input into one line. torch only: no Ray, no DeepSpeed, no Transformers or timm here.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ray_zero.models.spec import ModelSpec

if TYPE_CHECKING:
    from ray_zero.models.finetune import FineTuneSpec


class ModelError(ValueError):
    """A problem with the model input, in one line (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class ModelSource:
    """The experiment's model, its fields in one place (Experiment.model_source()): what describe_model
    counts and build_model_spec builds."""

    model: str
    """A preset, hf:TYPE, timm:NAME or a factory (config.Experiment.model)."""
    model_config: dict | None = None
    seq_len: int | None = None
    input_shape: list[int] | None = None
    num_classes: int | None = None
    finetune: Optional["FineTuneSpec"] = None
    """LoRA and frozen parameters (models/finetune.py), applied once the model is built."""

    @classmethod
    def of(cls, source: "ModelSource | str", *args: Any, **kwargs: Any) -> "ModelSource":
        """`source` itself, or a ModelSource of a model string and the other fields."""
        return source if isinstance(source, ModelSource) else cls(source, *args, **kwargs)


@dataclass
class Built:
    """What a source made of the `model:` string: the spec and what the driver reports of it."""

    spec: ModelSpec
    kind: str
    """"preset" | "hf" | "timm" | "factory"."""
    task: str
    """"image-classification" | "causal-lm" | "masked-lm" | "seq2seq-lm" | "custom"."""
    seq_len: int | None = None
    max_positions: int | None = None
    detail: str = ""
    """The tail of the description: ", seq_len 1024" or ", input 3x224x224, 1000 classes"."""


def checkpoint_blocks(blocks: Iterable[nn.Module]) -> Callable[[nn.Module], None]:
    """An enable_checkpointing that recomputes each block in backward (non-reentrant torch checkpoint)."""
    blocks = list(blocks)

    def enable(module: nn.Module) -> None:
        for block in blocks:
            if not getattr(block, "_ray_zero_checkpointed", False):  # twice would recompute twice
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
                block._ray_zero_checkpointed = True

    return enable


def find_blocks(module: nn.Module) -> list[nn.Module] | None:
    """The repeated layers, found without knowing the model: of the classes of module that are items of
    a ModuleList or Sequential (containers and leaves like Linear aside), the one whose outermost
    instances hold the most parameters; all its outermost instances, in order. None if there is none."""
    containers = (nn.ModuleList, nn.Sequential)
    candidates = {
        type(child)
        for container in module.modules()
        if isinstance(container, containers)
        for child in container.children()
        if not isinstance(child, containers) and next(child.children(), None) is not None
    }

    def outermost(cls: type, root: nn.Module = module):
        for child in root.children():
            yield from [child] if type(child) is cls else outermost(cls, child)

    def held(cls: type) -> int:
        return sum(p.numel() for block in outermost(cls) for p in block.parameters())

    best = max(candidates, key=held, default=None)
    return list(outermost(best)) if best is not None else None


def classifier_spec(
    module: nn.Module,
    shape: tuple,
    num_classes: int,
    blocks,
    enable,
    call: Callable[[Any, torch.Tensor], torch.Tensor] = lambda model, images: model(images),
) -> ModelSpec:
    """A ModelSpec training `module` on random images of `shape` with uniform labels: cross-entropy."""

    def make_batch(
        n: int, device: torch.device, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn((n, *shape), device=device, generator=generator)
        return images, torch.randint(0, num_classes, (n,), device=device, generator=generator)

    def loss(model, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(call(model, images).float(), labels)

    return ModelSpec(module, make_batch, loss, blocks or None, enable or None)


def classifier(
    module: nn.Module,
    shape,
    num_classes: int,
    kind: str,
    blocks: list[nn.Module] | None = None,
    enable=None,
    call: Callable[[Any, torch.Tensor], torch.Tensor] = lambda model, images: model(images),
) -> Built:
    """What a source returns for an image classifier (`classifier_spec`): its repeated blocks (found when
    not given) and their checkpointing (torch.utils.checkpoint around each block when not given)."""
    blocks = find_blocks(module) if blocks is None else blocks
    enable = (blocks and checkpoint_blocks(blocks)) if enable is None else enable
    spec = classifier_spec(module, tuple(shape), num_classes, blocks, enable, call)
    detail = f", input {'x'.join(map(str, shape))}, {num_classes} classes"
    return Built(spec, kind, "image-classification", detail=detail)


def refuse(source: str, why: str, **given) -> None:
    """A ModelError naming the inputs that `source` would silently ignore."""
    unused = [f"{key} {value}" for key, value in given.items() if value is not None]
    if unused:
        raise ModelError(f"{', '.join(unused)} not used by {source} ({why})")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__
