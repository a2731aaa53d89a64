"""`hf:TYPE`: a Transformers model from its configuration class (random weights, nothing downloaded),
trained on the task its users train it on, with synthetic batches of the right shapes and the loss the
model returns:

    seq2seq-lm            encoder-decoder (t5, bart, ...): source token ids and target labels of seq_len
    masked-lm             encoder-only (bert, roberta, ...): 15% of the positions masked and labelled
    causal-lm             decoder-only (gpt2, llama, mixtral, ...): next-token prediction on token ids
    image-classification  vit, convnext, ...: random images, uniform labels

The task is the first of these whose Transformers auto mapping holds the type (BERT is in the causal-LM
mapping too, as BertLMHeadModel, but its users train a masked LM). torch and Transformers only.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ray_zero.models.source import (
    Built,
    ModelError,
    checkpoint_blocks,
    classifier,
    did_you_mean,
    find_blocks,
    one_line,
    refuse,
)
from ray_zero.models.spec import ModelSpec

DEFAULT_SEQ_LEN = 1024
"""A token model's seq_len when the experiment gives none: this, or the model's maximum positions if fewer."""
MASKED_FRACTION = 0.15
"""BERT's share of masked positions."""
TOKEN_TASKS = ("seq2seq-lm", "masked-lm", "causal-lm")


def build_hf(model_type: str, config: dict, seq_len, input_shape, num_classes, counting: bool) -> Built:
    try:
        import transformers
        from transformers import CONFIG_MAPPING, AutoConfig
        from transformers.models.auto import modeling_auto
    except ImportError as error:
        raise ModelError(
            f"hf: models need the transformers package, which did not import ({one_line(error)}); "
            "pip install -r requirements.txt"
        ) from None

    source = f"hf:{model_type}"
    if model_type not in CONFIG_MAPPING:
        raise ModelError(
            f"unknown hf model type {model_type!r}{did_you_mean(model_type, CONFIG_MAPPING.keys())}"
            "; allowed: Transformers' model types (transformers.CONFIG_MAPPING)"
        )
    config_class = CONFIG_MAPPING[model_type]
    # Transformers keeps unknown keys silently, so a typo would train the default shape: refuse it.
    known = (
        set(config_class().to_dict())
        | set(inspect.signature(config_class.__init__).parameters)
        | set(getattr(config_class, "attribute_map", {}))
        | {"num_labels", "attn_implementation", "experts_implementation", "decoder_start_token_id"}
    ) - {"self", "kwargs"}
    for key in config:
        if key not in known:
            raise ModelError(f"unknown model_config key {key!r} for {source}{did_you_mean(key, known)}")
    mappings = {
        "seq2seq-lm": ("AutoModelForSeq2SeqLM", modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        "masked-lm": ("AutoModelForMaskedLM", modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        "causal-lm": ("AutoModelForCausalLM", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "image-classification": (
            "AutoModelForImageClassification",
            modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        ),
    }
    task = next((task for task, (_, names) in mappings.items() if model_type in names), None)
    if task is None:
        raise ModelError(
            f"{source} has no task ray_zero trains: it is in none of Transformers' auto mappings "
            f"{', '.join(auto for auto, _ in mappings.values())}"
        )
    if task == "image-classification":
        refuse(source, "seq_len is for token models", seq_len=seq_len)
        if num_classes is not None:
            config.setdefault("num_labels", num_classes)
    else:
        refuse(
            source,
            f"a {task} model trains on token ids of seq_len",
            input_shape=input_shape,
            num_classes=num_classes,
        )
    try:
        hf_config = AutoConfig.for_model(model_type, **config)
    except Exception as error:
        raise ModelError(f"building {source} with model_config {config} failed: {one_line(error)}") from None
    text_config = _text_config(hf_config)
    max_positions = getattr(text_config, "max_position_embeddings", None) if task in TOKEN_TASKS else None
    if not isinstance(max_positions, int) or max_positions < 1:  # XLNet's -1: no limit
        max_positions = None
    defaulted = seq_len is None
    if max_positions is not None:
        seq_len = seq_len or min(DEFAULT_SEQ_LEN, max_positions)
        if seq_len > max_positions:
            raise ModelError(
                f"seq_len {seq_len} exceeds {source}'s maximum positions {max_positions} (allowed: 1 to "
                f"{max_positions}); lower seq_len or raise max_position_embeddings in model_config"
            )
    seq_len = seq_len or (DEFAULT_SEQ_LEN if task in TOKEN_TASKS else None)
    if task == "seq2seq-lm":
        # T5's configuration class leaves the decoder's start unset (its checkpoints say 0): T5 starts
        # decoding from its pad token. EncoderDecoderConfig has neither (its shift of the labels needs both).
        pad = getattr(text_config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else 0
        if getattr(hf_config, "decoder_start_token_id", None) is None:
            hf_config.decoder_start_token_id = pad
        if getattr(hf_config, "pad_token_id", None) is None:
            hf_config.pad_token_id = pad
    # Training keeps no key/value cache. Counting on meta keeps it: without a cache Transformers
    # checks the positions for packed sequences, a data-dependent test that meta tensors cannot answer.
    if hasattr(hf_config, "use_cache"):
        hf_config.use_cache = counting and hf_config.use_cache
    # Counting runs on meta: eager attention's matmuls are ordinary ops that FlopCounterMode sees, and
    # batched_mm experts (mixture-of-experts models) multiply each token by the weights of its routed
    # experts only, with bmm, which meta and FlopCounterMode both know; Transformers' default grouped_mm
    # checks CUDA's dtypes on meta (bf16/fp16 only) and is not counted. Training keeps the defaults, or
    # the model_config's attn_implementation and experts_implementation.
    counted = {"attn_implementation": "eager", "experts_implementation": "batched_mm"} if counting else {}
    classes = mappings[task][1][model_type]
    if not isinstance(classes, str) and not getattr(hf_config, "architectures", None):
        # A type with several classes for the task (DeiT, LeViT: with and without a teacher) makes
        # Transformers 5's from_config read config.architectures, None in a configuration made from
        # scratch: the first class is the task's plain one.
        hf_config.architectures = [classes[0]]
    try:
        module = getattr(transformers, mappings[task][0]).from_config(hf_config, **counted)
    except Exception as error:
        raise ModelError(f"building {source} with model_config {config} failed: {one_line(error)}") from None
    limit = _positions_from_padding(module)
    if limit is not None and max_positions is not None and seq_len > limit:
        if not defaulted:
            raise ModelError(
                f"seq_len {seq_len} exceeds {source}'s positions: it numbers them from its padding index, so "
                f"max_position_embeddings {max_positions} leaves {limit} (allowed: 1 to {limit}); lower "
                "seq_len or raise max_position_embeddings in model_config"
            )
        seq_len, max_positions = limit, limit
    blocks = find_blocks(module)
    enable = (
        _hf_checkpointing
        if module.supports_gradient_checkpointing
        else (blocks and checkpoint_blocks(blocks))
    )
    if task == "image-classification":
        shape = tuple(input_shape or _image_shape(hf_config))
        logits = lambda model, images: model(pixel_values=images).logits  # noqa: E731
        return classifier(module, shape, hf_config.num_labels, "hf", blocks or [], enable, call=logits)
    make_batch = {"causal-lm": _token_ids, "masked-lm": _masked_tokens, "seq2seq-lm": _source_and_target}[
        task
    ]
    if task == "causal-lm":
        module.loss_type = "ForCausalLM"  # says so, instead of Transformers warning that it guessed
    tokens = dict(vocab=text_config.vocab_size, seq_len=seq_len)
    if task == "masked-lm":
        tokens["mask_id"] = _mask_id(text_config)
    spec = ModelSpec(module, functools.partial(make_batch, **tokens), _loss, blocks, enable)
    detail = f", seq_len {seq_len}" + (" (source and target)" if task == "seq2seq-lm" else "")
    return Built(spec, "hf", task, seq_len, max_positions, detail=detail)


def _token_ids(
    n: int, device: torch.device, generator: torch.Generator, *, vocab: int, seq_len: int
) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq_len), device=device, generator=generator)


def _masked_tokens(n, device, generator, *, vocab, seq_len, mask_id) -> dict[str, torch.Tensor]:
    """BERT's objective: a fixed share of positions per sample replaced by the mask token and labelled with
    the token that was there; the rest unlabelled (-100). At least one position, so the loss is defined."""
    ids = _token_ids(n, device, generator, vocab=vocab, seq_len=seq_len)
    count = max(1, round(MASKED_FRACTION * seq_len))
    positions = torch.rand((n, seq_len), device=device, generator=generator).argsort(dim=1)[:, :count]
    labels = torch.full_like(ids, -100).scatter(1, positions, ids.gather(1, positions))
    return {"input_ids": ids.scatter(1, positions, mask_id), "labels": labels}


def _source_and_target(n, device, generator, *, vocab, seq_len) -> dict[str, torch.Tensor]:
    """Source token ids and target labels, both of seq_len; the model shifts the labels right itself to
    make the decoder's inputs."""
    return {
        "input_ids": _token_ids(n, device, generator, vocab=vocab, seq_len=seq_len),
        "labels": _token_ids(n, device, generator, vocab=vocab, seq_len=seq_len),
    }


def _loss(model, batch) -> torch.Tensor:
    # The model's own loss: Transformers shifts causal labels for next-token prediction, ignores -100
    # labels, and upcasts logits to fp32 first.
    if isinstance(batch, torch.Tensor):
        return model(input_ids=batch, labels=batch).loss.float()
    return model(**batch).loss.float()


def _positions_from_padding(module) -> int | None:
    """The positions a RoBERTa-style model can index: its learned position embeddings number them from
    padding_idx + 1 (Transformers' create_position_ids_from_input_ids), so a table of N rows holds N -
    padding_idx - 1 of them. None for a model without such a table."""
    for name, child in module.named_modules():
        if (
            name.endswith("position_embeddings")
            and isinstance(child, torch.nn.Embedding)
            and child.padding_idx is not None
        ):
            return child.num_embeddings - child.padding_idx - 1
    return None


def _text_config(hf_config):
    """The configuration of the model's text part: a vision- or audio-language model's text_config
    (Gemma 3, Llama 4, Qwen2-Audio: their vocabulary, positions and pad token are there), else the
    configuration itself."""
    try:
        text = hf_config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return hf_config
    return text if hasattr(text, "vocab_size") else hf_config


def _image_shape(hf_config) -> tuple[int, ...]:
    """Channels, height, width: the configuration's image_size and num_channels, else its vision_config's
    (CLIP, SigLIP), else IMAGE_DEFAULTS' (convolutional networks such as ResNet and RegNet name no size:
    any size trains them)."""
    vision = getattr(hf_config, "vision_config", None)

    def find(key):
        values = (getattr(c, key, None) for c in (hf_config, vision) if c is not None)
        return next((v for v in values if v is not None), IMAGE_DEFAULTS[key])

    size = find("image_size")
    return (find("num_channels"), *((size, size) if isinstance(size, int) else size))


IMAGE_DEFAULTS = {"image_size": 224, "num_channels": 3}
"""An image classifier's input where its configuration names none: ImageNet's 3x224x224."""


def _mask_id(hf_config) -> int:
    """The config's mask token if it names one, else the last id of the vocabulary (any fixed id will do
    for random tokens)."""
    mask = getattr(hf_config, "mask_token_id", None)
    return mask if isinstance(mask, int) else hf_config.vocab_size - 1


def _hf_checkpointing(module) -> None:
    module.config.use_cache = False
    if hasattr(module, "activation_checkpointing_enable"):  # the name since Transformers 5.x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
