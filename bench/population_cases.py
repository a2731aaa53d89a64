"""The GPU population's sizes (issue 65): each family at a size its users train, not the conformance run's
shrunk one, and the micro-batch chosen from its traced step before anything runs. Everything here runs
on the CPU (the meta device): a child of bench/population_gpu.py calls it before it touches the GPU.

- timm: the family's smallest model (population.json's) at its pretrained input size (timm_source reads
  pretrained_cfg), its own classes (10 for a headless encoder, as in the conformance run).
- Transformers: the type's default configuration; seq_len left to ray_zero (1024, or the model's
  maximum positions if fewer); over PARAMS_LIMIT parameters, its layer counts (hf_shrink's LAYER_KEYS,
  in sub-configurations too) cut by one fraction until it is at most that.
- The micro-batch: the largest of 1, 2, 4, ..., 256 whose traced step (DeepSpeed's bf16 form, no
  checkpointing: the largest of the forms run) rises at most `target` bytes above what was allocated
  before it, with its own gradients; at least 1 (2 where the step could not be traced).
"""

from __future__ import annotations

from typing import Any, Optional

from hf_shrink import HF_OVERRIDES, LAYER_KEYS, _per_layer_lists, sub_configs

PARAMS_LIMIT = 1_500_000_000
MIN_LAYERS = 2
"""A cut keeps at least two layers of each count (hf_shrink's LAYERS): a hybrid keeps one of each kind."""
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
SHARED_KEYS = ("num_kv_shared_layers",)
"""Layers among the layers that reuse earlier layers' key/value caches (Gemma 3n): none once the layers are
cut (hf_shrink's COUNTS; the kept layers' kinds no longer match the cache's sources)."""
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")
SIZES = tuple(2**i for i in range(9))  # 1 .. 256
DEFAULT_FIXES = {t: HF_OVERRIDES[t] for t in ("esm", "deepseek_v2")}
"""Defaults that Transformers' own code cannot run (hf_shrink.HF_OVERRIDES says so): a checkpoint's values."""
GIB = 2**30


class _Counted(Exception):
    """describe_model's parameter count, raised before it counts FLOPs (seconds for a large model)."""

    def __init__(self, params: int):
        super().__init__(params)
        self.params = params


def count_params(source) -> int:
    from ray_zero.models.describe import describe_model

    def stop(params: int) -> None:
        raise _Counted(params)

    try:
        describe_model(source, check_params=stop)
    except _Counted as counted:
        return counted.params
    raise RuntimeError("describe_model did not count the parameters")  # pragma: no cover


def source_of(case: dict[str, Any]):
    from ray_zero.models.source import ModelSource

    return ModelSource(
        case["model"], case.get("model_config") or None, case.get("seq_len"), case.get("input_shape"),
        case.get("num_classes"),
    )  # fmt: skip


def smallest_trained_timm(module: str) -> str:
    """The timm module's smallest model by parameters (counted on the meta device), its test_ models aside."""
    import timm
    import torch

    counted = []
    for name in timm.list_models(module=module):
        if name.startswith("test_"):
            continue
        try:
            with torch.device("meta"):
                counted.append((sum(p.numel() for p in timm.create_model(name).parameters()), name))
        except Exception:  # one that does not build on meta is not the smallest that does
            continue
    return f"timm:{min(counted)[1]}"


def sized_case(
    case: dict[str, Any], limit: int = PARAMS_LIMIT, seq_len: Optional[int] = None
) -> dict[str, Any]:
    """`case` (population.json's) at the size users train: model, model_config, seq_len, input_shape,
    num_classes, params, and `size_why` (one line). `seq_len`: a token model's, instead of ray_zero's rule
    (the CPU smoke test's short one)."""
    base = {k: case.get(k) for k in ("model", "num_classes")} | {"seq_len": None, "input_shape": None}
    if case["source"] == "timm":
        sized = {**base, "model_config": {}}
        why = "the family's smallest timm model at its pretrained input size"
        if sized["model"].startswith("timm:test_"):  # timm's own test models: nobody trains those
            sized["model"] = smallest_trained_timm(case["family"])
            why = "the family's smallest timm model but its test_ ones, at its pretrained input size"
        sized["params"] = count_params(source_of(sized))
        sized["size_why"] = why
        return sized
    model_type = case["family"]
    text = case.get("task") != "image-classification"
    sized = {
        **base,
        "model_config": dict(DEFAULT_FIXES.get(model_type, {})),
        "seq_len": seq_len if text else None,
    }
    try:
        params = count_params(source_of(sized))
    except Exception as error:  # a default its own modelling code cannot take: the values None stands for
        repaired = _repaired(model_type)
        if not repaired:
            raise
        sized["model_config"].update(repaired)
        params = count_params(source_of(sized))
        sized["repaired"] = f"{', '.join(f'{k} {v}' for k, v in repaired.items())} (the default: {error})"
    sized["params"] = params
    sized["size_why"] = f"the default configuration ({params / 1e9:.3g} B parameters)"
    if params > limit:
        sized.update(_cut(model_type, sized, params, limit))
    if sized.get("repaired"):
        sized["size_why"] += f"; repaired: {sized['repaired']}"
    return sized


def _repaired(model_type: str) -> dict[str, Any]:
    """What hf_shrink sets where a default's None fails in the modelling code (Ministral's and HunYuan's
    head_dim, Nemotron's key/value heads): the value None stands for."""
    from transformers import CONFIG_MAPPING

    values = CONFIG_MAPPING[model_type]().to_dict()
    heads, width = values.get("num_attention_heads"), values.get("hidden_size")
    repaired = {}
    if "head_dim" in values and values["head_dim"] is None and heads and width:
        repaired["head_dim"] = width // heads
    if "num_key_value_heads" in values and values["num_key_value_heads"] is None and heads:
        repaired["num_key_value_heads"] = heads
    return repaired


def _cut(model_type: str, sized: dict, params: int, limit: int) -> dict[str, Any]:
    """The layer counts cut by one fraction, 10 % less at a time from limit / params, until the model is
    within `limit` or MIN_LAYERS of each are left; then, if still over, the experts the same way (down
    to the experts each token takes)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fixes = sized["model_config"]
    default = config_class(**fixes)

    def counted(layers: float, experts: float = 1.0) -> tuple[dict, int]:
        config = {**fixes, **cut_config(config_class, layers, experts, default)}
        return config, count_params(source_of({**sized, "model_config": config}))

    def floored(config: dict, layers: float, experts: float) -> bool:  # nothing left to cut
        return config == {**fixes, **cut_config(config_class, layers, experts, default)}

    layers, experts = min(1.0, limit / params), 1.0  # a first guess: the embeddings make it cut too few
    config, cut = counted(layers)
    for _ in range(60):  # 10 % fewer at a time: at most that much below the limit
        if cut <= limit or floored(config, 0.0, experts):
            break
        layers *= 0.9
        config, cut = counted(layers)
    for _ in range(60):
        if cut <= limit or floored(config, layers, 0.0):
            break
        experts *= 0.9
        config, cut = counted(layers, experts)
    kept = {k: v for k, v in _flat(config).items() if k.split(".")[-1] in LAYER_KEYS + EXPERT_KEYS}
    over = "" if cut <= limit else f"; still over {limit / 1e9:.3g} B"
    return {
        "model_config": config,
        "params": cut,
        "params_default": params,
        "size_why": f"the default configuration ({params / 1e9:.3g} B parameters) cut to "
        f"{', '.join(f'{k} {v}' for k, v in kept.items())}: {cut / 1e9:.3g} B{over}",
    }


def cut_config(config_class, layers: float, experts: float = 1.0, default=None) -> dict[str, Any]:
    """The keyword arguments that keep `layers` of each layer count of `config_class` (at least
    MIN_LAYERS: a hybrid keeps a layer of each kind) and `experts` of each expert count (at least the
    experts a token takes), its sub-configurations too; per-layer lists cut to the layers kept
    (hf_shrink's rule)."""
    import inspect

    default = default if default is not None else config_class()
    takes = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    defaults = default.to_dict()
    values = {key: defaults.get(key) for key in takes}
    top_k = max([values[k] for k in TOP_K_KEYS if isinstance(values.get(k), int)] or [1])
    cut: dict[str, Any] = {}
    cuts = ((LAYER_KEYS, layers, MIN_LAYERS), (SHARED_KEYS, 0.0, 0), (EXPERT_KEYS, experts, max(top_k, 2)))
    for keys, fraction, least in cuts:
        for key in keys:
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > least:
                kept = max(least, int(value * fraction))
                if kept < value:
                    cut[key] = kept
    cut.update(_per_layer_lists(values, {k: v for k, v in cut.items() if k in LAYER_KEYS}))
    for name, sub in sub_configs(config_class, default):
        inner = cut_config(type(sub), layers, experts, sub)
        if inner:
            cut[name] = {"model_type": sub.model_type, **inner}
    return cut


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def choose_micro_batch(source, target_bytes: float) -> dict[str, Any]:
    """The micro-batch for every form of the family, from its traced step (DeepSpeed's bf16 module, no
    checkpointing) on the meta device: `micro_batch`, `tried` ([size, rise GiB] each), `micro_batch_why`."""
    from ray_zero.models.describe import build_model_spec
    from ray_zero.train.step_trace import build_on_meta, module_form, prepare, trace_step

    form = module_form("deepspeed", "bf16")
    tried: list[list] = []
    chosen: Optional[int] = None
    why = ""
    rises: dict[int, float] = {}

    def within(size: int) -> bool:
        if size not in rises:
            step = trace_step(spec, size, form, False)
            rises[size] = step.rise(step.gradient_bytes)
            tried.append([size, round(rises[size] / GIB, 4)])
        return rises[size] <= target_bytes

    # The rise grows with the micro-batch, at most in proportion from one sample: the size one sample's
    # rise allows is a lower bound; then up while within the target, down while not (3 traces, not 9).
    try:
        spec = build_on_meta(lambda: build_model_spec(source))
        prepare(spec, form, False)
        if within(SIZES[0]):
            chosen = max(s for s in SIZES if s * rises[SIZES[0]] <= target_bytes or s == SIZES[0])
            while chosen > SIZES[0] and not within(chosen):
                chosen = SIZES[SIZES.index(chosen) - 1]
            while chosen < SIZES[-1] and within(SIZES[SIZES.index(chosen) + 1]):
                chosen = SIZES[SIZES.index(chosen) + 1]
    except Exception as error:  # TraceError or the model's own: untraced: the smallest size, and the reason
        from ray_zero.models.source import one_line

        why = f"; the trace stopped: {one_line(error)[:300]}"
    if chosen is None:  # untraced: 2, as the one-sample count takes (BatchNorm refuses 1 sample a channel)
        smallest = 2 if why else 1
        why = f"{smallest} (none traced within the target){why}"
        return {"micro_batch": smallest, "tried": tried, "micro_batch_why": why}
    capped = chosen == SIZES[-1] and tried[-1][0] == chosen
    rule = f"the largest of 1-{SIZES[-1]} whose traced bf16 step rises at most {target_bytes / GIB:.3g} GiB"
    return {
        "micro_batch": chosen,
        "tried": tried,
        "micro_batch_why": f"{chosen}: {rule}" + (" (the largest tried)" if capped else "") + why,
    }
