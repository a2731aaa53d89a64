"""Conformance: does ray_zero handle every model family a user may bring? (issue 42)

The population: the smallest model (by parameters, counted on the meta device) of every timm architecture
family (`timm.list_modules()`), and every Transformers model type whose task ray_zero trains (the four
auto mappings ray_zero/models/hf_source.py picks the task from), shrunk through its configuration's size
keys. Each model, in a worker process under torch.distributed (gloo, world size 1, as a sweep's rank):

    describe  ray_zero.models.describe.describe_model on the meta device
    train     3 steps, bf16, micro-batch 2, on DeepSpeed ZeRO-1 and on FSDP2 (stage 3), with
              ray_zero.train.worker.train: the loss finite, and each kind of model-state bytes the memory
              model's (to the byte, Adam's step counters aside: tests/test_zoo.py's rule)
    calibrate the first engine that trains, at its smallest stage, at sizes of 4, 8 and 12 MiB of
              activations (calibration_probes); the fit's verdict

One JSON line per model in OUTPUT/results.jsonl: a rerun skips the models there. Each model has a time
limit (its worker is killed at it: "timeout after N s"). The table goes to docs/conformance.md.

    nice -n 19 python bench/conformance.py --output /tmp/conformance             # everything, resumes
    nice -n 19 python bench/conformance.py --output /tmp/c --only timm:resnet18 hf:gpt2   # a few
    python bench/conformance.py --output /tmp/conformance --table-only           # the table again
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import platform
import re
import signal
import socket
import sys
import time
import traceback
from collections import defaultdict
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # appended: a PYTHONPATH snapshot of ray_zero, if given, comes first

ENGINES = (("deepspeed", 1), ("fsdp", 3))
"""The engines every model trains on: DeepSpeed ZeRO-1, FSDP2 with parameters sharded."""
ENGINE_TITLES = {"deepspeed": "DeepSpeed ZeRO-1", "fsdp": "FSDP2 (stage 3)"}
PRECISION = "bf16"
STEPS, WARMUP_STEPS, MICRO_BATCH = 3, 1, 2
SEQ_LEN = 32
CALIBRATION_STEPS = 2
"""A calibration trial's length here: its micro-batch measured in the first step (Experiment.probe, one
step of warm-up), not the third (calibration.probe_experiment). On the CPU the fit is of autograd's saved
bytes, the same at every step; bf16 runs 10x slower than fp32 on this AVX2 CPU, and the three sizes hold
64 MiB to 192 MiB of activations each, so the 3 steps saved are most of a model's time."""
CALIBRATE_ONCE = True
"""Each model is calibrated on the first engine that trains it (DeepSpeed at stage 0, else FSDP2 at stage
2), not on both: the fit is of autograd's saved bytes on the CPU, the module's own (the engines differ in
it only by what they cast), and one calibration a model is what made the run fit in its time."""
CALIBRATION_FLOOR_BYTES = 4 * 2**20
"""The smallest calibration size's activations here (calibration_probes): 4, 8 and 12 MiB, above the fit's
1 MiB floor for a measured slope."""
LARGE_PARAMS = 50_000_000
"""A model this large runs alone (its engines and calibration take GBs beside the other engineer's work)."""
STATES = ("parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes")
RESULTS_FILE, POPULATION_FILE = "results.jsonl", "population.json"
TABLE = ROOT / "docs" / "conformance.md"
READY_TIMEOUT_S = 180
"""A worker's start: spawn, imports (torch, DeepSpeed, Transformers, timm), the process group."""
MODELS_PER_WORKER = 25
"""A worker is started afresh after this many models (and after any failure): what one model leaves in
the process (allocator fragmentation, a library's global state) does not reach many others."""

# ----------------------------------------------------------------------------------------- the population

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
    for name in getattr(config_class, "sub_configs", {}) or {}:
        try:
            sub = getattr(default, name, None)
        except Exception:
            continue
        if sub is None or not hasattr(sub, "to_dict"):
            continue
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


def hf_case(model_type: str, level: str = "shrunk") -> dict[str, Any]:
    from transformers import CONFIG_MAPPING

    task = hf_task(model_type)
    config = shrunk_config(CONFIG_MAPPING[model_type], level)
    if level != "default":
        config.update(HF_OVERRIDES.get(model_type, {}))
    return {
        "id": f"hf:{model_type}",
        "source": "transformers",
        "family": model_type,
        "task": task,
        "model": f"hf:{model_type}",
        "model_config": config,
        "seq_len": None if task == "image-classification" else SEQ_LEN,
        "input_shape": None,
        "num_classes": None,
        "shrink": level,
    }


def hf_case_that_describes(model_type: str) -> dict[str, Any]:
    """The type at the first shrink level ray_zero describes on the meta device (a few seconds at most);
    the errors of the levels before it say what the shrink got wrong."""
    from ray_zero.models.describe import describe_model
    from ray_zero.models.source import ModelSource

    refused = {}
    for level in SHRINK_LEVELS:
        case = hf_case(model_type, level)
        try:
            info = describe_model(ModelSource(case["model"], case["model_config"], case["seq_len"]))
        except Exception as error:
            refused[level] = _one_line(error)[-300:]
            continue
        return {**case, "params_counted": info.params, "shrink_refused": refused}
    return {**case, "shrink_refused": refused}


def timm_cases() -> list[dict[str, Any]]:
    """The smallest model of each timm module, by parameters counted on the meta device; a model that
    does not build there counts as the largest (it is picked only when nothing else in its family builds)."""
    import timm
    import torch

    cases = []
    for module in timm.list_modules():
        counted = []
        for name in timm.list_models(module=module):
            try:
                with torch.device("meta"):
                    model = timm.create_model(name, pretrained=False)
                counted.append((sum(p.numel() for p in model.parameters()), name))
            except Exception:
                counted.append((math.inf, name))
        params, name = min(counted)
        # A feature extractor (no head by default: SAM's and the VLMs' encoders) is a classifier once a
        # user gives it classes, as they would.
        pretrained = timm.get_pretrained_cfg(name)
        headless = pretrained is not None and not pretrained.num_classes
        cases.append(
            {
                "id": f"timm:{name}",
                "source": "timm",
                "family": module,
                "task": "image-classification",
                "model": f"timm:{name}",
                "model_config": {},
                "seq_len": None,
                "input_shape": None,
                "num_classes": 10 if headless else None,
                "family_size": len(counted),
                "params_counted": params if params != math.inf else None,
            }
        )
    return cases


SMALL_IMAGE = 96
"""timm models train at 96x96 where they take it: the family's code path at a fifth of the pixels of its
usual 224 (what made 98 families fit in the run's time on this 2-core machine, shared with others' work)."""


def sized_cases(case: dict[str, Any]) -> list[dict[str, Any]]:
    """The configurations to describe the case at, small first; the worker takes the first that ray_zero
    describes. timm: at SMALL_IMAGE (img_size for a model of fixed input size, as timm's pretrained_cfg
    says, else the input shape alone: a convolutional network takes any), then as listed. Transformers:
    the type shrunk by this harness's current rules (hf_case: the population may be older), at the first
    level that describes."""
    if case["source"] == "timm" and not case["model_config"] and not case["input_shape"]:
        import timm

        pretrained = timm.get_pretrained_cfg(case["model"].split(":", 1)[1])
        if getattr(pretrained, "fixed_input_size", False):
            return [{**case, "model_config": {"img_size": SMALL_IMAGE}}, case]
        return [{**case, "input_shape": [3, SMALL_IMAGE, SMALL_IMAGE]}, case]
    if case["source"] == "transformers":
        return [{**case, **hf_case(case["family"], level)} for level in SHRINK_LEVELS]
    return [case]


def build_population() -> list[dict[str, Any]]:
    import transformers

    transformers.logging.set_verbosity_error()  # each level's warnings about the configurations it tries
    return timm_cases() + [hf_case_that_describes(t) for t in hf_types()]


def load_population(output: Path) -> list[dict[str, Any]]:
    """The population, counted once (timm's 1,300-odd models on the meta device take minutes) and kept in
    OUTPUT/population.json; counted in a child process, so this long-lived driver holds no models."""
    path = output / POPULATION_FILE
    if not path.is_file():
        with mp.get_context("spawn").Pool(1) as pool:
            cases = pool.apply(build_population)
        _atomic_write(path, json.dumps(cases, indent=1))
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------ one model, in a worker


def experiment_of(case: dict[str, Any]):
    """The experiment a user would write for this model: bf16 on the CPU, both engines, 3 steps."""
    from ray_zero.experiment_file import validate_experiment

    return validate_experiment(
        {
            "name": case["id"],
            "model": case["model"],
            "model_config": case["model_config"],
            "seq_len": case["seq_len"],
            "input_shape": case["input_shape"],
            "num_classes": case["num_classes"],
            "device": "cpu",
            "precision": PRECISION,
            "steps": STEPS,
            "warmup_steps": WARMUP_STEPS,
            "calibrate": True,
            "grid": {
                "backend": [backend for backend, _ in ENGINES],
                "stage": sorted({stage for _, stage in ENGINES}),
                "micro_batch_size": [MICRO_BATCH],
                "num_workers": [1],
            },
        },
        source=case["id"],
    )


def run_trial(spec) -> dict[str, Any]:
    """One trial on this rank, its row made as a sweep makes it (ray_zero/rows.py)."""
    import torch

    from ray_zero.rows import aggregate_ranks, failed_row_fields, finish_row, trial_row
    from ray_zero.train.worker import train

    row = trial_row(spec)
    started = time.perf_counter()
    try:
        report = train(spec, 0, 1, torch.device("cpu"))
    except Exception as error:  # recorded; the model's other checks go on
        row.update(failed_row_fields({0: error}))
        row["traceback"] = traceback.format_exc()[-3000:]
    else:
        row.update(status="ok", **aggregate_ranks([report]))
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return finish_row(row)


def states_check(row: dict[str, Any], trainable_tensors: int) -> dict[str, Any]:
    """Each kind of model-state bytes against the memory model's: exact, but for the optimizer states'
    Adam step counters (4 bytes per tensor the rank steps, which the model leaves out): tests/test_zoo.py."""
    from ray_zero.measure.memory_model import predict_point

    predicted = predict_point(row)
    found = {}
    for state in STATES:
        measured, expected = row[f"{state}_per_rank_max"], getattr(predicted, state)
        slack = 4 * trainable_tensors + 4 if state == "optimizer_state_bytes" else 0
        found[state] = {
            "measured": measured,
            "predicted": expected,
            "ok": measured is not None and expected <= measured <= expected + slack,
        }
    return found


def calibration_probes(model) -> list:
    """Each engine's calibration points at its smallest stage, at sizes s, 2s, 3s where s keeps about
    CALIBRATION_FLOOR_BYTES of activations (autograd's saved bytes, the meta count halved for bf16).
    calibration.calibration_sizes asks for 64 MiB at least and twice the gradients: on a GPU the
    allocator's rounding and workspaces need that, on a CPU the fit is of autograd's exact saved bytes,
    and 64-192 MiB of bf16 activations cost minutes a model on this CPU."""
    from ray_zero.config import BACKEND_STAGES, Point

    saved = model.saved_bytes_per_sample
    smallest = max(1, min(math.ceil(CALIBRATION_FLOOR_BYTES / (saved * 0.5)), 64)) if saved else 1
    return [
        Point(backend, BACKEND_STAGES[backend][0], smallest * k, 1)
        for backend, _ in ENGINES
        for k in range(1, 4)
    ]


def check_case(case: dict[str, Any], progress) -> dict[str, Any]:
    """Describe, train on each engine, calibrate each engine: the model's record."""
    from ray_zero.config import Point, TrialSpec
    from ray_zero.measure import calibration
    from ray_zero.models.describe import describe_model

    record: dict[str, Any] = {"id": case["id"], "engines": {}}
    progress("describe", record)
    started = time.perf_counter()
    failure = None
    for sized in sized_cases(case):  # the first that describes; the listed case's error if none does
        try:
            experiment = experiment_of(sized)
            model = describe_model(experiment.model_source())
        except Exception as error:
            failure = (_one_line(error), traceback.format_exc()[-3000:])
            continue
        case, failure = sized, None
        break
    record.update(
        model_config=case["model_config"], input_shape=case["input_shape"], shrink=case.get("shrink")
    )
    if failure is not None:
        record.update(status="describe failed", error=failure[0], traceback=failure[1])
        return record
    record.update(
        params=model.params,
        task=model.task,
        description=model.description,
        saved_bytes_per_sample=model.saved_bytes_per_sample,
        describe_s=round(time.perf_counter() - started, 1),
    )

    if model.params > case["max_params"]:  # this machine's memory, shared with others' work
        record.update(
            status="too large",
            error=f"{model.params:,} parameters, over the harness's --max-params {case['max_params']:,}",
        )
        return record

    def spec(point, length=experiment, label=""):
        return TrialSpec(length, point, PRECISION, False, model, "unused", label=label)

    trainable_tensors = len(model.trainable_param_shapes)
    probes = calibration_probes(model)
    calibrated = None
    for backend, stage in ENGINES:
        progress(f"{backend} training", record)
        row = run_trial(spec(Point(backend, stage, MICRO_BATCH, 1)))
        engine = record["engines"][backend] = {
            "stage": stage,
            "status": row["status"],
            "error": row.get("error"),
            "traceback": row.get("traceback"),
            "loss_first": row.get("loss_first"),
            "loss_last": row.get("loss_last"),
            "wall_s": row["wall_s"],
        }
        if row["status"] != "ok":
            continue
        engine["states"] = states_check(row, trainable_tensors)
        if calibrated:  # one calibration a model: the first engine that trains (CALIBRATE_ONCE)
            engine["calibration"] = {"skipped": f"calibrated on {calibrated}"}
            continue
        calibrated = backend
        rows = []
        for point in (p for p in probes if p.backend == backend):
            progress(f"{backend} calibration, micro-batch {point.micro_batch_size}", record)
            rows.append(run_trial(spec(point, experiment.probe(CALIBRATION_STEPS), "calibration")))
        fit = calibration.fit_lines(rows, on_gpu=False)[0]
        engine["calibration"] = {
            "verdict": fit["verdict"],
            "stage": rows[0]["stage"],
            "points": fit["points"],
            "bytes_per_sample": fit["bytes_per_sample"],
            "errors": sorted({r["error"] for r in rows if r.get("error")}),
            "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        }
    record["status"] = "checked"
    return record


def worker_main(port: int, log_path: str, connection) -> None:
    """A rank as a sweep starts one (gloo, world size 1); it checks the models it is sent, one at a time,
    and says where it is in each (the driver's record of a model it times out)."""
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    import torch
    import torch.distributed as dist

    from ray_zero.train.worker import jit_ops_dir

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        TORCH_EXTENSIONS_DIR=jit_ops_dir(),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # as a Ray Train worker with one CPU: two workers share the 2 cores
    dist.init_process_group("gloo", rank=0, world_size=1)
    connection.send(("ready", None))
    while True:
        case = connection.recv()
        if case is None:
            break
        print(f"=== {case['id']} {time.strftime('%H:%M:%S')}", flush=True)

        def progress(where: str, record: dict) -> None:
            print(f"--- {where} {time.strftime('%H:%M:%S')}", flush=True)
            connection.send(("progress", {"where": where, "record": record}))

        try:
            record = check_case(case, progress)
        except Exception as error:  # the harness's own failure: recorded as such
            record = {
                "id": case["id"],
                "status": "harness error",
                "error": _one_line(error),
                "traceback": traceback.format_exc()[-3000:],
            }
        connection.send(("done", record))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:400]}" if text else type(error).__name__


def _atomic_write(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text)
    partial.replace(path)


class Worker:
    """One worker process and the model it is checking."""

    def __init__(self, index: int, output: Path):
        self.index, self.output = index, output
        self.process = self.connection = None
        self.case: Optional[dict] = None
        self.started = 0.0
        self.where, self.partial = "starting", {}
        self.checked = 0

    def start(self) -> None:
        context = mp.get_context("spawn")
        mine, theirs = context.Pipe()
        log = self.output / f"worker{self.index}.log"
        self.process = context.Process(target=worker_main, args=(_free_port(), str(log), theirs), daemon=True)
        self.process.start()
        self.connection, self.checked = mine, 0
        if not mine.poll(READY_TIMEOUT_S) or mine.recv()[0] != "ready":
            self.stop()
            raise RuntimeError(f"worker {self.index} did not start in {READY_TIMEOUT_S} s (see {log})")

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            self.connection.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.join()
        self.process = self.connection = None

    def send(self, case: dict) -> None:
        if self.process is None or not self.process.is_alive() or self.checked >= MODELS_PER_WORKER:
            self.stop()
            self.start()
        self.case, self.started, self.where, self.partial = case, time.monotonic(), "sent", {}
        self.connection.send(case)

    def receive(self) -> Optional[dict]:
        """The model's record once it is done (None while it goes on); a dead worker's record says so."""
        try:
            kind, value = self.connection.recv()
        except (EOFError, OSError):
            code = self.process.exitcode if self.process is not None else None
            self.kill()
            return self._end("worker died", f"the worker process died (exit code {code}) during {self.where}")
        if kind == "progress":
            self.where, self.partial = value["where"], value["record"]
            return None
        self.checked += 1
        if value.get("status") != "checked" or _failures(value):
            self.stop()  # a failure may leave state behind (a half-built engine): the next model starts clean
        return self._finish(value)

    def timed_out(self, limit_s: float) -> Optional[dict]:
        if self.case is None or time.monotonic() - self.started < limit_s:
            return None
        self.kill()
        return self._end("timeout", f"timeout after {limit_s:.0f} s (during {self.where})")

    def _end(self, status: str, error: str) -> dict:
        return self._finish({**self.partial, "id": self.case["id"], "status": status, "error": error})

    def _finish(self, record: dict) -> dict:
        record = {
            **{
                k: self.case.get(k)
                for k in ("source", "family", "task", "model", "model_config", "family_size", "shrink")
            },
            **record,
            "wall_s": round(time.monotonic() - self.started, 1),
            "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        self.case = None
        return record


def _failures(record: dict) -> list[str]:
    return [b for b, e in record.get("engines", {}).items() if engine_result(e)[0] != "pass"]


def _large(case: dict) -> bool:
    return (case.get("params_counted") or 0) > LARGE_PARAMS


def _next_case(queue: list[dict], running: list[dict]) -> Optional[dict]:
    """The next model to start beside `running`: none beside a large one, a large one only alone (so the
    large ones run last, one at a time)."""
    if any(map(_large, running)):
        return None
    return next((case for case in queue if not (running and _large(case))), None)


def run(cases: list[dict], output: Path, jobs: int, limit_s: float, max_params: int) -> None:
    """Check every case, `jobs` at a time, appending each record to OUTPUT/results.jsonl as it ends."""
    results = output / RESULTS_FILE
    queue = sorted(cases, key=_large)  # the large ones last, one at a time
    workers = [Worker(i, output) for i in range(jobs)]
    total, done, began = len(queue), 0, time.monotonic()
    try:
        while queue or any(w.case for w in workers):
            for worker in workers:
                case = _next_case(queue, [w.case for w in workers if w.case is not None])
                if worker.case is None and case is not None:
                    queue.remove(case)
                    worker.send({**case, "max_params": max_params})
            busy = [w for w in workers if w.case is not None]
            ready = wait([w.connection for w in busy], timeout=5)
            for worker in busy:
                record = worker.receive() if worker.connection in ready else worker.timed_out(limit_s)
                if record is None:
                    continue
                with results.open("a") as file:
                    file.write(json.dumps(record, default=str) + "\n")
                done += 1
                elapsed = time.monotonic() - began
                print(f"[{done}/{total} {elapsed:.0f} s] {record['id']}: {summary_line(record)}", flush=True)
    finally:
        for worker in workers:
            worker.stop()


# ------------------------------------------------------------------------------------------- the table


def engine_result(engine: Optional[dict]) -> tuple[str, str]:
    """An engine's verdict on a model and, unless it passed, the one-line reason: the first check that
    failed (training, the loss, the model states, the calibration)."""
    if engine is None:
        return "not run", ""
    if engine["status"] != "ok":
        return "training fails", engine.get("error") or engine["status"]
    first, last = engine.get("loss_first"), engine.get("loss_last")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (first, last)):
        return "loss not finite", f"loss {first} at the first step, {last} at the last"
    off = [
        f"{state} measured {check['measured']}, predicted {check['predicted']:.0f}"
        for state, check in engine["states"].items()
        if not check["ok"]
    ]
    if off:
        return "states differ", "; ".join(off)
    fit = engine.get("calibration")
    if fit is None:
        return "not calibrated", "calibration did not finish"
    if "skipped" in fit:
        return "pass", ""
    if fit["verdict"] != "ok":
        errors = f" ({'; '.join(fit['errors'])})" if fit["errors"] else ""
        word = "calibration fails" if fit["errors"] else "calibration doubtful"
        return word, f"calibration at stage {fit['stage']}: {fit['verdict']}{errors}"
    return "pass", ""


def model_results(record: dict) -> tuple[dict[str, str], str]:
    """Each engine's word for the model, and the reason of its failures in one line."""
    if record["status"] not in ("checked", "timeout", "worker died"):  # described or not, not trained
        return {b: record["status"] for b, _ in ENGINES}, str(record.get("error"))
    results = {b: engine_result(record.get("engines", {}).get(b)) for b, _ in ENGINES}
    if record["status"] != "checked":  # what it did before it was stopped, and where it stopped
        results = {
            b: (word, reason)
            if word not in ("not run", "not calibrated")
            else (record["status"], record["error"])
            for b, (word, reason) in results.items()
        }
    words = {b: word for b, (word, _) in results.items()}
    reasons = [(b, reason) for b, (_, reason) in results.items() if reason]
    if len({reason for _, reason in reasons}) == 1:
        return words, reasons[0][1]
    return words, "; ".join(f"{ENGINE_TITLES[b]}: {reason}" for b, reason in reasons)


def summary_line(record: dict) -> str:
    words, reason = model_results(record)
    params = f"{record['params']:,} params, " if record.get("params") else ""
    return f"{params}" + ", ".join(f"{b} {w}" for b, w in words.items()) + (f" ({reason})" if reason else "")


def cause_of(reason: str) -> str:
    """A failure's cause, for grouping: the reason without what differs from model to model (numbers,
    names in quotes, the class names of the model)."""
    text = re.sub(r"^(rank \d+: )", "", reason)
    text = re.sub(r"0x[0-9a-f]+", "ADDR", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(
        r"\b[A-Z][A-Za-z0-9]*(Model|Config|ForCausalLM|ForMaskedLM|Layer|Attention)\w*", "Class", text
    )
    return re.sub(r"\d+", "N", text)[:200]


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "timm", "deepspeed"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def ray_zero_source() -> str:
    """Which ray_zero the workers import (a snapshot on PYTHONPATH, or this checkout) and its commit."""
    import importlib.util
    import subprocess

    origin = Path(importlib.util.find_spec("ray_zero").origin).parent.parent
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if origin == ROOT:
        return f"this checkout ({commit} with any uncommitted changes)"
    stamp = origin / "COMMIT"  # written beside the copy when it was taken
    taken = stamp.read_text().strip() if stamp.is_file() else "an unrecorded commit"
    return f"{origin}: a copy of ray_zero/ at {taken}, on PYTHONPATH"


def read_records(output: Path) -> dict[str, dict]:
    """The latest record of each model (a retried model's last)."""
    path = output / RESULTS_FILE
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["id"]] = record
    return records


def write_table(output: Path, table: Path) -> str:
    records = read_records(output)
    path = output / POPULATION_FILE
    # The models of a run with --only in a folder of its own are what its records hold.
    population = json.loads(path.read_text()) if path.is_file() else list(records.values())
    log = output / "runs.jsonl"
    runs = (
        [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    )
    full = [r for r in runs if not r.get("only")] or runs
    took = sum(r.get("wall_s", 0) for r in runs)
    last = runs[-1] if runs else {"versions": versions()}  # a run still going has written none yet
    dates = sorted(r["finished"][:10] for r in records.values())
    lines = [
        "# Conformance: the model families a user may bring",
        "",
        "Written by `bench/conformance.py` (issue 42; bench/conformance.md tells the story). Each model: "
        "described on the meta device, then trained 3 steps in bf16 (micro-batch 2, one CPU rank under "
        "gloo, as a sweep's rank) on DeepSpeed ZeRO-1 and FSDP2 (stage 3), then calibrated on the "
        "first engine that trained it, at its smallest stage (DeepSpeed 0, else FSDP2 2), at three "
        "micro-batches of about 4, 8 and 12 MiB of activations. **pass**: the loss is finite, the four "
        "kinds of model-state bytes are the memory model's (to the byte; Adam's step counters aside), "
        "and, on the engine calibrated, the calibration's verdict is ok. timm models at 96x96 where they "
        "take it (the input column), Transformers types shrunk to 2 layers of width 64 (seq_len 32, images "
        "64x64) where their configuration allows.",
        "",
        f"- Hardware: {last.get('machine', '?')} (a 2-core CPU VM shared with other work; bf16 without "
        f"native support), one worker process a model, `--jobs` at a time, `nice -n 19`; reruns' records "
        f"appended to the first run's results.jsonl",
        f"- Run: {dates[0] if dates else '-'} to {dates[-1] if dates else '-'}, "
        f"{took / 3600:.1f} h over {len(runs)} invocation(s)",
        *(f"- Command: `{r['command']}`" for r in full[:1] + [r for r in runs if r.get("only")]),
        f"- ray_zero: {last.get('ray_zero', '?')}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in last["versions"].items()),
        "",
    ]
    sections = (
        ("timm", "timm: the smallest model of each family (module)"),
        ("transformers", "Transformers: each model type, shrunk"),
    )
    summary, causes, fallbacks = [], defaultdict(dict), []
    body: list[str] = []
    for source, title in sections:
        mine = [c for c in population if c["source"] == source]
        found = [records[c["id"]] for c in mine if c["id"] in records]
        passes = {b: sum(model_results(r)[0][b] == "pass" for r in found) for b, _ in ENGINES}
        summary.append(
            f"- {source}: {len(found)} of {len(mine)} {'families' if source == 'timm' else 'types'} run; "
            + ", ".join(f"{ENGINE_TITLES[b]} passes {n}" for b, n in passes.items())
            + f"; both pass {sum(set(model_results(r)[0].values()) == {'pass'} for r in found)}"
        )
        body += ["", f"## {title}", ""]
        first = "family | model" if source == "timm" else "type | task"
        body.append(
            f"| {first} | params | " + " | ".join(ENGINE_TITLES[b] for b, _ in ENGINES) + " | reason |"
        )
        body.append("|---" * (4 + len(ENGINES)) + "|")
        for case in mine:
            record = records.get(case["id"])
            if record is None:
                continue
            words, reason = model_results(record)
            name = case["model"].split(":", 1)[1] if source == "timm" else case["task"]
            shrink = record.get("shrink") or case.get("shrink") or "shrunk"
            if source == "transformers" and shrink != "shrunk":
                name += f" ({shrink})"
                fallbacks.append({**case, **record, "shrink": shrink})
            if source == "timm":
                size = (record.get("input_shape") or [None])[-1]
                size = size or (record.get("model_config") or {}).get("img_size")
                name += f" ({size}x{size})" if size else " (default size)"
            params = f"{record['params']:,}" if record.get("params") else "-"
            body.append(
                f"| {case['family']} | {name} | {params} | "
                + " | ".join(words[b] for b, _ in ENGINES)
                + f" | {_cell(reason)} |"
            )
            for backend, (word, why) in _by_engine(record).items():
                if word != "pass":
                    hits = causes[(word, cause_of(why))]
                    hits.setdefault(case["id"], []).append(backend)
                    hits.setdefault("", why)  # the first model's own line
    lines += ["## Summary", "", *summary, "", "## Failures by cause", ""]
    lines += ["| check | models (engines) | models | an error line |", "|---|---|---|---|"]
    for (word, _), hits in sorted(causes.items(), key=lambda item: -len(item[1])):
        example = hits.pop("")
        models = ", ".join(
            m + ("" if len(engines) == len(ENGINES) else f" ({', '.join(engines)})")
            for m, engines in hits.items()
        )
        lines.append(f"| {word} | {_cell(models)} | {len(hits)} | {_cell(example)} |")
    lines += [
        "",
        "## Transformers types the harness could not shrink",
        "",
        "Each type takes the first of: every size key shrunk, the layer counts, vocabulary and experts only "
        "(layers), the configuration class's defaults (default); the levels before it failed to describe:",
        "",
        "| type | level | params | the full shrink's error |",
        "|---|---|---|---|",
    ]
    for case in fallbacks:
        params = f"{case['params']:,}" if case.get("params") else "-"
        refused = case.get("shrink_refused", {}).get("shrunk", "") or "(see the record)"
        lines.append(f"| {case['family']} | {case['shrink']} | {params} | {_cell(refused)} |")
    text = "\n".join(lines + body) + "\n"
    table.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(table, text)
    return "\n".join(summary)


def _by_engine(record: dict) -> dict[str, tuple[str, str]]:
    words, _ = model_results(record)
    if record["status"] not in ("checked", "timeout", "worker died"):
        return {b: (w, str(record.get("error"))) for b, w in words.items()}
    out = {}
    for backend, word in words.items():
        reason = engine_result(record.get("engines", {}).get(backend))[1] or record.get("error") or ""
        out[backend] = (word, reason)
    return out


# ---------------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True, help="results.jsonl, population.json, logs")
    parser.add_argument("--only", nargs="+", metavar="ID", help="these models (timm:NAME, hf:TYPE) only")
    parser.add_argument("--jobs", type=int, default=1, help="models checked at once, one worker each")
    parser.add_argument("--timeout-s", type=float, default=1200, help="each model's time limit")
    parser.add_argument(
        "--max-params", type=int, default=200_000_000, help="a larger model is recorded, not trained"
    )
    parser.add_argument(
        "--retry",
        nargs="+",
        default=[],
        metavar="STATUS",
        help="check again the models recorded with these statuses (timeout, 'worker died')",
    )
    parser.add_argument("--table", type=Path, help=f"default {TABLE.relative_to(ROOT)}, OUTPUT's with --only")
    parser.add_argument("--table-only", action="store_true", help="write the table from results.jsonl")
    args = parser.parse_args()
    # A SIGTERM (kill) stops the workers too, as Ctrl-C does: the models they check are not recorded.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.output.mkdir(parents=True, exist_ok=True)
    table = args.table or (args.output / "conformance.md" if args.only else TABLE)
    command = " ".join(
        ([f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else [])
        + ["nice", "-n", str(os.nice(0))] * bool(os.nice(0))
        + ["python", "bench/conformance.py", *sys.argv[1:]]
    )
    if not args.table_only:
        began = time.monotonic()
        if args.only:  # the population's case where it was counted already, else made here
            path = args.output / POPULATION_FILE
            known = {c["id"]: c for c in json.loads(path.read_text())} if path.is_file() else {}
            population = [known.get(i) or _extra_case(i) for i in args.only]
        else:
            population = load_population(args.output)
        records = read_records(args.output)
        todo = [c for c in population if c["id"] not in records or records[c["id"]]["status"] in args.retry]
        print(
            f"conformance: {len(todo)} of {len(population)} models to check, {args.jobs} at a time",
            flush=True,
        )
        run(todo, args.output, args.jobs, args.timeout_s, args.max_params)
        with (args.output / "runs.jsonl").open("a") as file:
            file.write(
                json.dumps(
                    {
                        "command": command,
                        "only": bool(args.only),
                        "checked": len(todo),
                        "wall_s": round(time.monotonic() - began, 1),
                        "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                        "versions": versions(),
                        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                        "ray_zero": ray_zero_source(),
                    }
                )
                + "\n"
            )
    print(write_table(args.output, table), f"\nconformance: the table is in {table}", sep="\n", flush=True)
    return 0


def _extra_case(model_id: str) -> dict[str, Any]:
    """A model outside the population (--only timm:resnet18): a timm name as it is, an hf type shrunk."""
    if model_id.startswith("hf:"):
        return hf_case_that_describes(model_id[3:])
    return {
        "id": model_id,
        "source": "timm",
        "family": "(not the family's smallest)",
        "task": "image-classification",
        "model": model_id,
        "model_config": {},
        "seq_len": None,
        "input_shape": None,
        "num_classes": None,
    }


if __name__ == "__main__":
    sys.exit(main())
