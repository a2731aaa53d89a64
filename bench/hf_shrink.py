"""The Transformers shrink of bench/conformance.py: each model type's configuration made small (2 layers of
width 64, a vocabulary of 1000, few experts) through the size keys its configuration class takes, for a
model that trains in seconds on a CPU. Transformers only, imported where used.
"""

from __future__ import annotations

from typing import Any, Optional

TASK_MAPPINGS = (
    ("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
)
"""hf_source's order: a type's task is the first mapping that holds it."""

LAYERS, WIDTH, HEADS, FFN, VOCAB = 2, 64, 4, 128, 1000
HEAD_DIM = WIDTH // HEADS
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
)
SIZES = {
    "hidden_size": WIDTH,
    "d_model": WIDTH,
    "n_embd": WIDTH,
    "embedding_dim": WIDTH,
    "hidden_size_per_layer_input": HEAD_DIM,
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "num_heads": HEADS,
    "n_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "head_dim": HEAD_DIM,
    "d_kv": HEAD_DIM,
    "d_head": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    "attention_head_size": HEAD_DIM,
    "rotary_dim": HEAD_DIM // 2,
    "intermediate_size": FFN,
    "ffn_dim": FFN,
    "d_ff": FFN,
    "n_inner": FFN,
    "d_inner": FFN,
    "encoder_ffn_dim": FFN,
    "decoder_ffn_dim": FFN,
    "ffn_hidden_size": FFN,
    # Multi-head latent attention (DeepSeek, LongCat): small ranks, head dimensions that add up.
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": HEAD_DIM // 2,
    "qk_nope_head_dim": HEAD_DIM // 2,
    "v_head_dim": HEAD_DIM,
    "image_size": 64,  # image classifiers: 64x64 inputs (the patch sizes, 4 to 16, divide it)
}
"""Widths: 64 wide, 4 heads of 16."""
COUNTS = {
    "vocab_size": VOCAB,
    "decoder_vocab_size": VOCAB,
    "src_vocab_size": VOCAB,
    "tgt_vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    # Mixture of experts: four experts, two per token, narrow ones.
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "moe_intermediate_size": FFN // 2,
    "shared_expert_intermediate_size": FFN // 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "zero_expert_num": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_kv_shared_layers": 0,
}
"""Counts that are not widths: a vocabulary of 1000, few experts."""
DEPTH_LISTS = ("depths", "block_sizes")
"""Per-stage layer counts (Swin, ConvNeXt, ResNet, Funnel): one layer a stage."""
HF_OVERRIDES: dict[str, dict[str, Any]] = {
    # Shapes the generic shrink cannot know.
    "reformer": {
        "axial_pos_shape": [4, 8],  # multiplies to seq_len
        "axial_pos_embds_dim": [16, 48],  # adds up to hidden_size
        "local_attn_chunk_length": 16,
        "lsh_attn_chunk_length": 16,
    },
    "squeezebert": {"embedding_size": WIDTH},
    "mobilebert": {"embedding_size": 32, "true_hidden_size": 32, "intra_bottleneck_size": 32},
    "mamba2": {"num_heads": 2 * WIDTH // HEAD_DIM, "n_groups": 1},  # heads x head_dim = expand x width
    "gpt_neo": {"attention_types": [[["global", "local"], LAYERS // 2]]},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "xlstm": {"num_blocks": LAYERS, "qk_dim_factor": 1.0},  # 0.5 at width 64: "matC_old has wrong shape"
    "dory": {"n_input_layers": LAYERS, "n_recurrent_layers": 0, "n_output_layers": 0},  # they add up
    "zamba": {  # two hybrid layers: one alone fails Transformers' check of the tied shared block
        "num_hidden_layers": 4,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
        "attention_hidden_size": 2 * WIDTH,
        "attention_head_dim": 2 * WIDTH // HEADS,
        "mamba_dt_rank": 8,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # All-Mamba defaults: counting keeps the key/value cache, and a cache of linear-attention layers alone
    # fails Transformers' mask sizing; the checkpoints have attention layers among them.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    # Defaults that do not run as they are (Transformers' own): what a checkpoint's configuration gives.
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    "deepseek_v2": {"num_experts_per_tok": 2},
}
"""Types whose shrunk configuration needs more than the generic rules to be valid."""
SHRINK_LEVELS = ("shrunk", "layers", "default")
"""How far a Transformers configuration is shrunk: every size key; the layer counts, vocabulary and experts
only (where the widths have constraints the rules do not know); nothing. A type takes the first level
that ray_zero describes, or the last (its failure is then ray_zero's or Transformers', not the shrink's)."""


def hf_task(model_type: str) -> Optional[str]:
    from transformers.models.auto import modeling_auto

    return next((task for task, names in TASK_MAPPINGS if model_type in getattr(modeling_auto, names)), None)


def hf_types() -> list[str]:
    from transformers.models.auto import modeling_auto

    return list(dict.fromkeys(t for _, names in TASK_MAPPINGS for t in getattr(modeling_auto, names)))


def sub_configs(config_class, default) -> list[tuple[str, Any]]:
    """(name, configuration) of each sub-configuration the default holds (text model, vision tower)."""
    found = []
    for name in getattr(config_class, "sub_configs", {}) or {}:
        try:
            sub = getattr(default, name, None)
        except Exception:  # a heterogeneous configuration refuses some attributes
            continue
        if sub is not None and hasattr(sub, "to_dict"):
            found.append((name, sub))
    return found


def shrunk_config(config_class, level: str = "shrunk", default=None) -> dict[str, Any]:
    """The keyword arguments that shrink `config_class` at `level` (its sub-configurations too): the size
    keys its __init__ takes whose defaults are larger integers, per-layer lists cut to the layers kept,
    MHA kept MHA, special token ids moved into the smaller vocabulary."""
    import inspect

    if level == "default":
        return {}
    if default is None:
        try:
            default = config_class()
        except Exception:  # no defaults to shrink from: the type's override says what it needs
            return {}
    takes = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    # From to_dict(): a heterogeneous configuration refuses to read a per-layer key (sliding_window)
    # globally as an attribute.
    defaults = default.to_dict()
    values = {key: defaults.get(key) for key in takes}
    targets = {**dict.fromkeys(LAYER_KEYS, LAYERS), **COUNTS, **(SIZES if level == "shrunk" else {})}
    shrunk: dict[str, Any] = {
        key: target
        for key, target in targets.items()
        if isinstance(values.get(key), int) and not isinstance(values[key], bool) and values[key] > target
    }
    if level == "shrunk":
        heads = next((values[k] for k in ("num_attention_heads", "n_head", "num_heads") if k in values), None)
        kv_heads = values.get("num_key_value_heads")
        if "head_dim" in values and values["head_dim"] is None:  # None is width / heads, which some
            shrunk["head_dim"] = HEAD_DIM  # modelling code (Ministral, HunYuan) cannot take
        if "num_key_value_heads" in values and kv_heads is None:  # likewise: None is MHA (Nemotron)
            shrunk["num_key_value_heads"] = HEADS
        if isinstance(kv_heads, int) and kv_heads == heads:  # multi-head attention stays so
            shrunk["num_key_value_heads"] = HEADS
        elif isinstance(kv_heads, int) and kv_heads > 2:
            shrunk["num_key_value_heads"] = 2
        if "qk_rope_head_dim" in shrunk:  # MLA: RoPE's part is the head_dim, the query's the sum
            shrunk.update({k: HEAD_DIM for k in ("qk_head_dim",) if k in values})
            shrunk.update({k: HEAD_DIM // 2 for k in ("head_dim",) if k in values})
    shrunk.update(_per_layer_lists(values, shrunk))
    for key, target in SIZES.items() if level == "shrunk" else ():
        if isinstance(shrunk.get(key), list):  # a width per layer (Gemma 3n's intermediate_size)
            shrunk[key] = [target] * len(shrunk[key])
    for key in DEPTH_LISTS:
        if isinstance(values.get(key), (list, tuple)):
            shrunk[key] = [1] * len(values[key])
    for name, sub in sub_configs(config_class, default):
        inner = shrunk_config(type(sub), level, sub)
        if inner:
            shrunk[name] = {"model_type": sub.model_type, **inner}
    vocab = shrunk.get("vocab_size")
    if vocab is not None:
        shrunk.update(_token_ids_within(defaults, vocab))
    return shrunk


def _per_layer_lists(values: dict[str, Any], shrunk: dict[str, Any]) -> dict[str, list]:
    """Lists with one entry per layer (layer_types, sparsity patterns), cut to the layers kept: the first
    layer and the first of another kind (a hybrid keeps an attention layer beside a recurrent one)."""
    layers = next((values[k] for k in LAYER_KEYS if k in shrunk and isinstance(values.get(k), int)), None)
    kept = next((shrunk[k] for k in LAYER_KEYS if k in shrunk), None)
    if layers is None or kept is None:
        return {}
    lists = {k: v for k, v in values.items() if isinstance(v, list) and len(v) == layers and layers > kept}
    # The layers' kinds: layer_types, else a list like it (Zamba's layers_block_type).
    mixed = [k for k, v in lists.items() if all(isinstance(x, str) for x in v) and len(set(v)) > 1]
    kinds = lists["layer_types"] if "layer_types" in mixed else lists[mixed[0]] if mixed else None
    keep = [0]
    if kinds:
        keep += [i for i, kind in enumerate(kinds) if kind != kinds[0]][:1]
    keep += [i for i in range(layers) if i not in keep][: kept - len(keep)]
    return {k: [v[i] for i in sorted(keep)] for k, v in lists.items()}


def _token_ids_within(defaults: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Special token ids at or above the shrunk vocabulary, moved to its last ids (equal ids stay equal)."""
    ids = {k: v for k, v in defaults.items() if k.endswith(("token_id", "token_index", "token_ids"))}

    def each(value):
        return value if isinstance(value, list) else [value]

    high = sorted(
        {v for value in ids.values() for v in each(value) if isinstance(v, int) and not isinstance(v, bool)}
        - set(range(vocab))
    )
    moved = {v: vocab - 1 - i for i, v in enumerate(high)}
    return {
        key: [moved.get(v, v) for v in value] if isinstance(value, list) else moved.get(value, value)
        for key, value in ids.items()
        if any(v in moved for v in each(value))
    }
