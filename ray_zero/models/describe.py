"""Model sources: the experiment's `model:` string made into facts for the driver and a ModelSpec for a rank.

    seed | base | large           the seed tutorial's Transformer at the sizes of
    ray_zero.models.presets.PRESETS
    hf:TYPE                       a Transformers model from its config (model_config), on its users' task:
                                  causal LM, masked LM, sequence-to-sequence or image classifier
                                  (hf_source.py)
    timm:NAME                     a timm classifier, model_config as create_model's keyword arguments
    package.module:function       a user's factory, called with **model_config; it returns a ModelSpec
    path/to/file.py:function      or an nn.Module classifier (then input_shape and num_classes are needed)

`describe_model` builds the model on the meta device (no memory) and counts its parameters (trainable and
frozen, tensor by tensor: what the engines partition) and its training FLOPs with torch's
FlopCounterMode (ray_zero/models/counting.py: where an operator has no meta kernel, on a real CPU
instance, or parameters without FLOPs, as the description says); `build_model_spec` builds it for real on
the CPU. Nothing is downloaded, transformers and timm are imported only for their sources, and every bad
input raises one ModelError line. No Ray, no DeepSpeed here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from ray_zero.models.counting import built_on_meta_or_cpu, flops_and_saved
from ray_zero.models.factory_source import FACTORY, build_factory
from ray_zero.models.finetune import apply_finetune
from ray_zero.models.hf_source import DEFAULT_SEQ_LEN, build_hf  # noqa: F401 (DEFAULT_SEQ_LEN: part of this module's API)
from ray_zero.models.presets import IMAGE_SIZE, NUM_CLASSES, PRESETS, ModelPreset
from ray_zero.models.source import (  # noqa: F401
    Built,
    ModelError,
    ModelSource,
    checkpoint_blocks,
    classifier,
    find_blocks,
    one_line,
    refuse,
)
from ray_zero.models.spec import ModelSpec, batch_bytes
from ray_zero.models.timm_source import build_timm

ALLOWED_FORMS = (
    f"allowed: a preset ({' | '.join(PRESETS)}), hf:TYPE, timm:NAME, "
    "package.module:function or path/to/file.py:function"
)


@dataclass(frozen=True)
class ModelInfo:
    """What the driver knows of a model before any training: plain data, no torch objects."""

    source: str
    """The model string as given."""
    kind: str
    """"preset" | "hf" | "timm" | "factory"."""
    task: str
    """"image-classification" | "causal-lm" | "masked-lm" | "seq2seq-lm" | "custom"."""
    params: int
    """Parameter count, tied weights counted once, frozen parameters included."""
    param_bytes: int
    """Bytes of all parameters in the dtype the model is built in."""
    flops_per_sample: float
    """Training FLOPs (forward + backward) per sample, counted by FlopCounterMode on the meta device
    (a mixture of experts: the routed experts' only)."""
    seq_len: int | None
    """Tokens per sample (token models), else None."""
    max_positions: int | None
    """A token model's maximum positions (its config's max_position_embeddings), else None."""
    description: str
    """One short line, e.g. "GPT2LMHeadModel (hf:gpt2), 124,439,808 parameters, seq_len 1024"."""
    trainable_param_shapes: tuple[tuple[int, ...], ...] = ()
    """The shape of each parameter that trains (requires_grad), in the module's order: what gets gradients,
    master copies and optimizer states, and what the engines partition (DeepSpeed's flat buffers in this
    order, ZeroRedundancyOptimizer whole tensors, FSDP2 each tensor's first dimension)."""
    frozen_param_shapes: tuple[tuple[int, ...], ...] = ()
    """The shape of each frozen parameter, in the module's order: held (cast, partitioned) like the others,
    with no gradient, master copy or optimizer state."""
    buffer_bytes: int = 0
    """Bytes of the module's floating-point buffers (running statistics, masks), as it is built: what DDP
    broadcasts from rank 0 before each forward."""
    batch_norm_param_shapes: tuple[tuple[int, ...], ...] = ()
    """The shapes of BatchNorm layers' parameters: FSDP2 gathers them in fp32 under half precision (their
    own groups, ray_zero/train/torch_engines.py)."""
    largest_block_params: int | None = None
    """Parameters of the largest repeated block (what FSDP2 gathers at a time), None without blocks."""
    blocks: int = 0
    """Repeated blocks: FSDP2 shards each as its own group (hooked before and after its forward and
    backward)."""
    modules: int = 0
    """Modules, the model itself included: DeepSpeed stage 3 hooks each before and after its forward and
    backward. 0 in descriptions of earlier versions (hooks not counted)."""
    unreached_params: tuple[int, ...] = ()
    """Indices (into trainable_param_shapes) of the trainable parameters the loss does not reach, found by
    the counting backward: no gradient in training (a pooler a masked LM skips, a vision-language model's
    vision tower under text-only batches). FSDP2 and torch's Adam then hold no gradient or states for them;
    DeepSpeed ZeRO-1/2 a zero gradient of each, beside its gradient buffer."""
    sample_bytes: int | None = None
    """Bytes of one sample's batch as the model's make_batch makes it (fp32 images and int64 tokens, with
    their labels), None where it could not be made: what synthetic data holds on a rank per sample."""
    saved_bytes_per_sample: int | None = None
    """Bytes autograd saves for backward for one sample (activations, each storage once, parameters left
    out), counted on the meta device in the dtype the model is built in: what calibration sizes from. An
    upper bound: on meta, attention keeps every head's attention matrix (eager, or SDPA's math path),
    which fused attention kernels do not (1.0-1.35x of the CPU's count on the tiny test models)."""

    by_seq_len: dict[int, "ModelInfo"] = field(default_factory=dict)
    """On a seq_len axis (grid.seq_len): the model described at each value (`describe_lengths`)."""

    def at(self, seq_len: int | None) -> "ModelInfo":
        """The description at one value of the seq_len axis (its seq_len, FLOPs and sample bytes); itself
        without an axis or at a value not described."""
        variant = self.by_seq_len.get(seq_len) if seq_len is not None else None
        return dataclasses.replace(variant, by_seq_len=self.by_seq_len) if variant is not None else self

    @property
    def trainable_params(self) -> int:
        """Parameters that train; all of them for a description without shapes (earlier versions)."""
        if not (self.trainable_param_shapes or self.frozen_param_shapes):
            return self.params
        return sum(math.prod(shape) for shape in self.trainable_param_shapes)


class SmallTransformer(nn.Module):
    """The seed tutorial's network: Conv2d patch embedding -> learned positions -> TransformerEncoder ->
    mean pool -> linear head, on 1x28x28 images."""

    def __init__(self, preset: ModelPreset):
        super().__init__()
        self.patch_embed = nn.Conv2d(1, preset.dim, kernel_size=preset.patch, stride=preset.patch)
        self.pos_embed = nn.Parameter(torch.randn(1, preset.num_patches, preset.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=preset.dim,
            nhead=preset.heads,
            dim_feedforward=preset.ff_dim,
            dropout=preset.dropout,
            batch_first=True,
        )
        # enable_nested_tensor only matters for padded inference; off avoids a warning.
        self.transformer = nn.TransformerEncoder(layer, num_layers=preset.depth, enable_nested_tensor=False)
        self.head = nn.Linear(preset.dim, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
        return self.head(self.transformer(tokens + self.pos_embed).mean(dim=1))


def describe_model(
    source: ModelSource | str,
    model_config: dict | None = None,
    seq_len: int | None = None,
    input_shape: list[int] | None = None,
    num_classes: int | None = None,
    check_params: Callable[[int], None] | None = None,
) -> ModelInfo:
    """Parameters and training FLOPs per sample of the model (a ModelSource, Experiment.model_source(); or
    a model string and its fields), built on the meta device (no memory used). `check_params(count)` runs
    before the FLOPs are counted (seconds for a large model): a model that cannot fit is refused without
    waiting for them."""
    source = ModelSource.of(source, model_config, seq_len, input_shape, num_classes)
    model = source.model
    # On the meta device; a model an operator without a meta kernel stops there is counted on the CPU,
    # and its description says so (ray_zero/models/counting.py).
    built, counted = built_on_meta_or_cpu(lambda: _build(source, counting=True))
    module = built.spec.module
    params = list(module.parameters())  # unique Parameter objects: tied embeddings count once
    count = sum(p.numel() for p in params)
    if check_params is not None:
        check_params(count)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    flops, saved, unreached = flops_and_saved(
        model, built.spec, counted, lambda: _build(source, counting=True).spec
    )
    blocks = built.spec.blocks
    largest_block = max(sum(p.numel() for p in block.parameters()) for block in blocks) if blocks else None
    frozen_note = f" ({frozen:,} of them frozen)" if frozen else ""
    return ModelInfo(
        source=model,
        kind=built.kind,
        task=built.task,
        params=count,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        flops_per_sample=flops,
        saved_bytes_per_sample=saved,
        seq_len=built.seq_len,
        max_positions=built.max_positions,
        description=f"{type(module).__name__} ({model}), {count:,} parameters{frozen_note}"
        + built.detail
        + counted.note,
        trainable_param_shapes=tuple(tuple(p.shape) for p in params if p.requires_grad),
        frozen_param_shapes=tuple(tuple(p.shape) for p in params if not p.requires_grad),
        largest_block_params=largest_block,
        blocks=len(blocks or ()),
        modules=sum(1 for _ in module.modules()),
        unreached_params=unreached,
        sample_bytes=_sample_bytes(built.spec),
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers() if b.is_floating_point()),
        batch_norm_param_shapes=tuple(
            tuple(p.shape)
            for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for p in m.parameters(recurse=False)
        ),
    )


def describe_lengths(
    source: ModelSource, lengths: Iterable[int] | None, check_params: Callable[[int], None] | None = None
) -> ModelInfo:
    """`describe_model` at each value of a seq_len axis (grid.seq_len; none: the source's own), the
    longest first (a value beyond the model's positions is refused before the others are counted); the
    shortest's description, holding every value's (ModelInfo.at). A bad value raises a ModelError that
    names it."""
    if not lengths:
        return describe_model(source, check_params=check_params)
    described: dict[int, ModelInfo] = {}
    for seq_len in sorted(set(lengths), reverse=True):
        try:
            described[seq_len] = describe_model(
                dataclasses.replace(source, seq_len=seq_len), check_params=None if described else check_params
            )
        except ModelError as error:
            raise ModelError(f"grid.seq_len {seq_len}: {error}") from None
    shortest = described[min(described)]
    values = ", ".join(str(n) for n in sorted(described))
    description = shortest.description.replace(f"seq_len {shortest.seq_len}", f"seq_len {values}", 1)
    return dataclasses.replace(shortest, by_seq_len=described, description=description)


def _sample_bytes(spec) -> int | None:
    try:
        return batch_bytes(spec.make_batch(1, torch.device("cpu"), torch.Generator().manual_seed(0)))
    except Exception:  # a factory's batch that cannot be made here: the prediction has no data term
        return None


def build_model_spec(
    source: ModelSource | str,
    model_config: dict | None = None,
    seq_len: int | None = None,
    input_shape: list[int] | None = None,
    num_classes: int | None = None,
) -> ModelSpec:
    """The real model, in training mode (seed torch first), and how to train it: on the CPU, or on the
    device of a `with torch.device(...)` around the call."""
    source = ModelSource.of(source, model_config, seq_len, input_shape, num_classes)
    spec = _build(source, counting=False).spec
    spec.module.train()
    return spec


def _build(source: ModelSource, counting: bool) -> Built:
    """The source's model, fine-tuned as the experiment says (LoRA, frozen parameters): what is
    described, traced and trained is the same module."""
    built = _build_source(source, counting)
    apply_finetune(built.spec.module, source.finetune, source.model)
    return built


def _build_source(source: ModelSource, counting: bool) -> Built:
    model, config, seq_len = source.model, source.model_config, source.seq_len
    input_shape, num_classes = source.input_shape, source.num_classes
    if config is not None and not isinstance(config, dict):
        raise ModelError(f"model_config must be a mapping of keyword arguments, not {type(config).__name__}")
    config = dict(config or {})
    if not isinstance(model, str) or not model:
        raise ModelError(f"model must be a non-empty string; {ALLOWED_FORMS}")
    if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 1):
        raise ModelError(f"seq_len must be a positive integer, not {seq_len!r}")
    if model in PRESETS:
        return _preset(model, config, seq_len, input_shape, num_classes)
    prefix, _, name = model.partition(":")
    if prefix == "hf" and name:
        return build_hf(name, config, seq_len, input_shape, num_classes, counting)
    if prefix == "timm" and name:
        return build_timm(name, config, seq_len, input_shape, num_classes)
    match = FACTORY.fullmatch(model)
    if match is None:
        raise ModelError(f"malformed model {model!r}; {ALLOWED_FORMS}")
    return build_factory(model, match["target"], match["function"], config, seq_len, input_shape, num_classes)


def _preset(name, config, seq_len, input_shape, num_classes) -> Built:
    if config:
        raise ModelError(
            f"preset {name!r} takes no model_config (got {sorted(config)}); its sizes are "
            "fixed in ray_zero/models/presets.py: use hf:, timm: or a factory for another shape"
        )
    shape = (1, IMAGE_SIZE, IMAGE_SIZE)
    refuse(
        name,
        "it trains on 1x28x28 MNIST-shaped images, 10 classes",
        seq_len=seq_len,
        input_shape=None if input_shape is None or tuple(input_shape) == shape else input_shape,
        num_classes=None if num_classes in (None, NUM_CLASSES) else num_classes,
    )
    module = SmallTransformer(PRESETS[name])
    return classifier(module, shape, NUM_CLASSES, "preset", blocks=list(module.transformer.layers))
