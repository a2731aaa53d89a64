"""Model sources: the experiment's `model:` string made into facts for the driver and a ModelSpec for a rank.

    seed | base | large           the seed tutorial's Transformer at the sizes of ray_zero.sizes.PRESETS
    hf:TYPE                       a Transformers causal LM or image classifier from its config (model_config)
    timm:NAME                     a timm classifier, model_config as create_model's keyword arguments
    package.module:function       a user's factory, called with **model_config; it returns a ModelSpec
    path/to/file.py:function      or an nn.Module classifier (then input_shape and num_classes are needed)

`describe_model` builds the model on the meta device (no memory) and counts its parameters and its
training FLOPs with torch's FlopCounterMode; `build_model_spec` builds it for real on the CPU. Nothing is
downloaded, transformers and timm are imported only for their sources, and every bad input raises one
ModelError line. No Ray, no DeepSpeed here.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from ray_zero.model_spec import Batch, ModelSpec
from ray_zero.sizes import IMAGE_SIZE, NUM_CLASSES, PRESETS, ModelPreset

DEFAULT_SEQ_LEN = 1024
"""An LM's seq_len when the experiment gives none: this, or the model's maximum positions if fewer."""

ALLOWED_FORMS = (f"allowed: a preset ({' | '.join(PRESETS)}), hf:TYPE, timm:NAME, "
                 "package.module:function or path/to/file.py:function")
_FACTORY = re.compile(r"(?P<target>[^:]+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<function>[A-Za-z_]\w*)")


class ModelError(ValueError):
    """A problem with the model input, in one line (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the driver knows of a model before any training: plain data, no torch objects."""

    source: str
    """The model string as given."""
    kind: str
    """"preset" | "hf" | "timm" | "factory"."""
    task: str
    """"image-classification" | "causal-lm" | "custom"."""
    params: int
    """Parameter count, tied weights counted once."""
    param_bytes: int
    """Bytes of all parameters in the dtype the model is built in."""
    flops_per_sample: float
    """Training FLOPs (forward + backward) per sample, counted by FlopCounterMode on the meta device."""
    seq_len: int | None
    """Tokens per sample (causal LMs), else None."""
    max_positions: int | None
    """A causal LM's maximum positions (its config's max_position_embeddings), else None."""
    description: str
    """One short line, e.g. "GPT2LMHeadModel (hf:gpt2), 124,439,808 parameters, seq_len 1024"."""


class SmallTransformer(nn.Module):
    """The seed tutorial's network: Conv2d patch embedding -> learned positions -> TransformerEncoder ->
    mean pool -> linear head, on 1x28x28 images."""

    def __init__(self, preset: ModelPreset):
        super().__init__()
        self.patch_embed = nn.Conv2d(1, preset.dim, kernel_size=preset.patch, stride=preset.patch)
        self.pos_embed = nn.Parameter(torch.randn(1, preset.num_patches, preset.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model=preset.dim, nhead=preset.heads, dim_feedforward=preset.ff_dim,
                                           dropout=preset.dropout, batch_first=True)
        # enable_nested_tensor only matters for padded inference; off avoids a warning.
        self.transformer = nn.TransformerEncoder(layer, num_layers=preset.depth, enable_nested_tensor=False)
        self.head = nn.Linear(preset.dim, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
        return self.head(self.transformer(tokens + self.pos_embed).mean(dim=1))


@dataclass
class _Built:
    spec: ModelSpec
    kind: str
    task: str
    seq_len: int | None = None
    max_positions: int | None = None
    detail: str = ""
    """The tail of the description: ", seq_len 1024" or ", input 3x224x224, 1000 classes"."""


def describe_model(model: str, model_config: dict | None = None, seq_len: int | None = None,
                   input_shape: list[int] | None = None, num_classes: int | None = None,
                   check_params: Callable[[int], None] | None = None) -> ModelInfo:
    """Parameters and training FLOPs per sample of `model`, built on the meta device (no memory used).
    `check_params(count)` runs before the FLOPs are counted (seconds for a large model): a model that
    cannot fit is refused without waiting for them."""
    with torch.device("meta"):
        built = _build(model, model_config, seq_len, input_shape, num_classes, counting=True)
    module = built.spec.module
    params = list(module.parameters())  # unique Parameter objects: tied embeddings count once
    count = sum(p.numel() for p in params)
    if check_params is not None:
        check_params(count)
    return ModelInfo(
        source=model, kind=built.kind, task=built.task, params=count,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        flops_per_sample=_training_flops_of_one_sample(model, built.spec),
        seq_len=built.seq_len, max_positions=built.max_positions,
        description=f"{type(module).__name__} ({model}), {count:,} parameters{built.detail}")


def build_model_spec(model: str, model_config: dict | None = None, seq_len: int | None = None,
                     input_shape: list[int] | None = None, num_classes: int | None = None) -> ModelSpec:
    """The real model on the CPU, in training mode (seed torch first), and how to train it."""
    spec = _build(model, model_config, seq_len, input_shape, num_classes, counting=False).spec
    spec.module.train()
    return spec


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
    candidates = {type(child) for container in module.modules() if isinstance(container, containers)
                  for child in container.children()
                  if not isinstance(child, containers) and next(child.children(), None) is not None}

    def outermost(cls: type, root: nn.Module = module):
        for child in root.children():
            yield from [child] if type(child) is cls else outermost(cls, child)

    def held(cls: type) -> int:
        return sum(p.numel() for block in outermost(cls) for p in block.parameters())

    best = max(candidates, key=held, default=None)
    return list(outermost(best)) if best is not None else None


def _build(model: str, config: dict | None, seq_len: int | None, input_shape: list[int] | None,
           num_classes: int | None, counting: bool) -> _Built:
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
        return _hf(name, config, seq_len, input_shape, num_classes, counting)
    if prefix == "timm" and name:
        return _timm(name, config, seq_len, input_shape, num_classes)
    match = _FACTORY.fullmatch(model)
    if match is None:
        raise ModelError(f"malformed model {model!r}; {ALLOWED_FORMS}")
    return _factory(model, match["target"], match["function"], config, seq_len, input_shape, num_classes)


def _preset(name, config, seq_len, input_shape, num_classes) -> _Built:
    if config:
        raise ModelError(f"preset {name!r} takes no model_config (got {sorted(config)}); its sizes are "
                         "fixed in ray_zero/sizes.py: use hf:, timm: or a factory for another shape")
    shape = (1, IMAGE_SIZE, IMAGE_SIZE)
    _refuse(name, "it trains on 1x28x28 MNIST-shaped images, 10 classes", seq_len=seq_len,
            input_shape=None if input_shape is None or tuple(input_shape) == shape else input_shape,
            num_classes=None if num_classes in (None, NUM_CLASSES) else num_classes)
    module = SmallTransformer(PRESETS[name])
    blocks = list(module.transformer.layers)
    spec = _classifier_spec(module, shape, NUM_CLASSES, blocks, checkpoint_blocks(blocks))
    return _Built(spec, "preset", "image-classification", detail=_image_detail(shape, NUM_CLASSES))


def _hf(model_type, config, seq_len, input_shape, num_classes, counting) -> _Built:
    try:
        from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification
        from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS,
                                                            MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as IMAGE_CLS)
    except ImportError as error:
        raise ModelError(f"hf: models need the transformers package, which did not import ({_one_line(error)}); "
                         "pip install -r requirements.txt") from None

    source = f"hf:{model_type}"
    if model_type not in CONFIG_MAPPING:
        raise ModelError(f"unknown hf model type {model_type!r}{_did_you_mean(model_type, CONFIG_MAPPING.keys())}"
                         "; allowed: Transformers' model types (transformers.CONFIG_MAPPING)")
    config_class = CONFIG_MAPPING[model_type]
    # Transformers keeps unknown keys silently, so a typo would train the default shape: refuse it.
    known = (set(config_class().to_dict()) | set(inspect.signature(config_class.__init__).parameters)
             | set(getattr(config_class, "attribute_map", {})) | {"num_labels", "attn_implementation"}) \
        - {"self", "kwargs"}
    for key in config:
        if key not in known:
            raise ModelError(f"unknown model_config key {key!r} for {source}{_did_you_mean(key, known)}")
    if model_type in CAUSAL_LMS:
        task, auto_class = "causal-lm", AutoModelForCausalLM
        _refuse(source, "a causal LM trains on token ids of seq_len", input_shape=input_shape, num_classes=num_classes)
    elif model_type in IMAGE_CLS:
        task, auto_class = "image-classification", AutoModelForImageClassification
        _refuse(source, "seq_len is for causal LMs", seq_len=seq_len)
        if num_classes is not None:
            config.setdefault("num_labels", num_classes)
    else:
        raise ModelError(f"{source} is neither a causal LM nor an image classifier in Transformers' auto "
                         "mappings (AutoModelForCausalLM, AutoModelForImageClassification)")
    try:
        hf_config = AutoConfig.for_model(model_type, **config)
    except Exception as error:
        raise ModelError(f"building {source} with model_config {config} failed: {_one_line(error)}") from None
    max_positions = getattr(hf_config, "max_position_embeddings", None) if task == "causal-lm" else None
    if max_positions is not None:
        seq_len = seq_len or min(DEFAULT_SEQ_LEN, max_positions)
        if seq_len > max_positions:
            raise ModelError(f"seq_len {seq_len} exceeds {source}'s maximum positions {max_positions}; "
                             "lower seq_len or raise max_position_embeddings in model_config")
    seq_len = seq_len or (DEFAULT_SEQ_LEN if task == "causal-lm" else None)
    # Training keeps no key/value cache. Counting on meta keeps it: without a cache Transformers
    # checks the positions for packed sequences, a data-dependent test that meta tensors cannot answer.
    if hasattr(hf_config, "use_cache"):
        hf_config.use_cache = counting and hf_config.use_cache
    try:
        # Eager attention for counting: its matmuls are ordinary ops that FlopCounterMode sees.
        module = auto_class.from_config(hf_config, **({"attn_implementation": "eager"} if counting else {}))
    except Exception as error:
        raise ModelError(f"building {source} with model_config {config} failed: {_one_line(error)}") from None
    blocks = find_blocks(module)
    enable = _hf_checkpointing if module.supports_gradient_checkpointing else (blocks and checkpoint_blocks(blocks))
    if task == "image-classification":
        size = hf_config.image_size
        shape = tuple(input_shape or (hf_config.num_channels, *((size, size) if isinstance(size, int) else size)))
        spec = _classifier_spec(module, shape, hf_config.num_labels, blocks, enable,
                                call=lambda model, images: model(pixel_values=images).logits)
        return _Built(spec, "hf", task, detail=_image_detail(shape, hf_config.num_labels))
    module.loss_type = "ForCausalLM"  # says so, instead of Transformers warning that it guessed
    vocab = hf_config.vocab_size

    def make_batch(n: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocab, (n, seq_len), device=device, generator=generator)

    def loss(model, token_ids: torch.Tensor) -> torch.Tensor:
        # Transformers shifts the labels for next-token prediction and upcasts logits to fp32 first.
        return model(input_ids=token_ids, labels=token_ids).loss.float()

    spec = ModelSpec(module, make_batch, loss, blocks, enable)
    return _Built(spec, "hf", task, seq_len, max_positions, detail=f", seq_len {seq_len}")


def _hf_checkpointing(module: nn.Module) -> None:
    module.config.use_cache = False
    if hasattr(module, "activation_checkpointing_enable"):  # the name since Transformers 5.x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _timm(name, config, seq_len, input_shape, num_classes) -> _Built:
    try:
        import timm
    except ImportError as error:
        raise ModelError(f"timm: models need the timm package, which did not import ({_one_line(error)}); "
                         "pip install -r requirements.txt") from None

    source = f"timm:{name}"
    _refuse(source, "seq_len is for causal LMs", seq_len=seq_len)
    if not timm.is_model(name):
        raise ModelError(f"unknown timm model {name!r}{_did_you_mean(name, timm.list_models())}"
                         "; allowed: timm.list_models()")
    if num_classes is not None:
        config.setdefault("num_classes", num_classes)
    try:
        module = timm.create_model(name, pretrained=False, **config)
    except Exception as error:
        raise ModelError(f"building {source} with model_config {config} failed: {_one_line(error)}") from None
    channels, height, width = module.pretrained_cfg["input_size"]
    size = config.get("img_size")  # the default size is the pretrained one, which img_size overrides
    if size is not None:
        height, width = (size, size) if isinstance(size, int) else size
    shape = tuple(input_shape or (config.get("in_chans", channels), height, width))
    spec = _classifier_spec(module, shape, module.num_classes, find_blocks(module),
                            lambda model: model.set_grad_checkpointing(True))
    return _Built(spec, "timm", "image-classification", detail=_image_detail(shape, module.num_classes))


def _factory(source, target, function, config, seq_len, input_shape, num_classes) -> _Built:
    _refuse(source, "a factory gets model_config only", seq_len=seq_len)
    factory = _load_factory(source, target, function)
    try:
        made = factory(**config)
    except Exception as error:
        raise ModelError(f"factory {source} raised {_one_line(error)}") from None
    if isinstance(made, ModelSpec):
        _refuse(source, "its ModelSpec makes its own batches", input_shape=input_shape, num_classes=num_classes)
        if made.enable_checkpointing is None and made.blocks:  # the protocol's default, made explicit
            made = replace(made, enable_checkpointing=checkpoint_blocks(made.blocks))
        return _Built(made, "factory", "custom")
    if not isinstance(made, nn.Module):
        raise ModelError(f"factory {source} returned {type(made).__name__}, not an nn.Module or a ModelSpec")
    if input_shape is None or num_classes is None:
        raise ModelError(f"factory {source} returned a plain nn.Module: give input_shape (e.g. [3, 32, 32]) and "
                         "num_classes for its images and labels, or return a ModelSpec")
    blocks = find_blocks(made)
    spec = _classifier_spec(made, tuple(input_shape), num_classes, blocks, blocks and checkpoint_blocks(blocks))
    return _Built(spec, "factory", "image-classification", detail=_image_detail(input_shape, num_classes))


def _load_factory(source: str, target: str, function: str) -> Callable[..., Any]:
    """The factory function; files are read relative to the working directory, which is also put on
    sys.path for package.module forms (Ray ships the working directory to the workers)."""
    cwd = os.getcwd()
    if target.endswith(".py"):
        path = Path(cwd, target)
        if not path.is_file():
            raise ModelError(f"factory file {target!r} not found (model {source!r}, read from {cwd})")
        name = "ray_zero_user_" + re.sub(r"\W", "_", str(path.with_suffix("")))
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickle look their module up here
        try:
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:
            del sys.modules[name]
            raise ModelError(f"importing factory file {target!r} failed: {_one_line(error)}") from None
    else:
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as error:
            if error.name and (target + ".").startswith(error.name + "."):
                raise ModelError(f"factory module {target!r} not found (model {source!r}; "
                                 "is it installed or under the working directory?)") from None
            raise ModelError(f"importing factory module {target!r} failed: {_one_line(error)}") from None
        except (Exception, SystemExit) as error:
            raise ModelError(f"importing factory module {target!r} failed: {_one_line(error)}") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ModelError(f"factory function {function!r} not found in {target!r}{_did_you_mean(function, names)}")
    return factory


def _classifier_spec(module: nn.Module, shape: tuple, num_classes: int, blocks, enable,
                     call: Callable[[Any, torch.Tensor], torch.Tensor] = lambda model, images: model(images)):
    """A ModelSpec training `module` on random images of `shape` with uniform labels: cross-entropy."""
    def make_batch(n: int, device: torch.device, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.randn((n, *shape), device=device, generator=generator)
        return images, torch.randint(0, num_classes, (n,), device=device, generator=generator)

    def loss(model, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(call(model, images).float(), labels)

    return ModelSpec(module, make_batch, loss, blocks or None, enable or None)


def _training_flops_of_one_sample(source: str, spec: ModelSpec) -> float:
    """FlopCounterMode's count of one forward + backward of a 1-sample batch, all on the meta device.
    The batch is made on the CPU (no meta generator exists) and moved to meta."""
    batch = _to_device(spec.make_batch(1, torch.device("cpu"), torch.Generator().manual_seed(0)), "meta")
    try:
        with FlopCounterMode(display=False) as counter:
            spec.loss(spec.module, batch).backward()
    except Exception as error:
        raise ModelError(f"a forward and backward of one sample of {source} failed on the meta device: "
                         f"{_one_line(error)}") from None
    return float(counter.get_total_flops())


def _to_device(batch: Batch, device) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(value, device) for value in batch)
    return batch


def _refuse(source: str, why: str, **given) -> None:
    """A ModelError naming the inputs that `source` would silently ignore."""
    unused = [f"{key} {value}" for key, value in given.items() if value is not None]
    if unused:
        raise ModelError(f"{', '.join(unused)} not used by {source} ({why})")


def _image_detail(shape, num_classes: int) -> str:
    return f", input {'x'.join(map(str, shape))}, {num_classes} classes"


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__
