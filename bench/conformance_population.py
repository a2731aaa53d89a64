"""The conformance population: the smallest model of every timm family and every Transformers type
ray_zero trains (hf_shrink.py shrinks those), each as a case, and the sizes a case is described at.
"""

from __future__ import annotations

import math
from typing import Any

from common import one_line
from hf_shrink import HF_OVERRIDES, SHRINK_LEVELS, hf_task, hf_types, shrunk_config

SEQ_LEN = 32
"""A token model's seq_len here."""


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
            refused[level] = one_line(error)[-300:]
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
