"""The error band of a predicted peak: how far measured peaks fell from the prediction for models of the
same class on a GPU (error_bands.json, made by bench/population_band.py from issue 65's GPU population,
its tuning families only), and what a GPU needs beyond the predicted peak for the step to fit.

The band holds where the population was measured: its GPU architecture and the torch releases between
the one that ran the steps and the one that traced them. Outside them it widens (WIDEN) and says why.
No torch import here: the running torch's version comes from its package metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

from packaging.version import Version

BANDS_FILE = Path(__file__).with_name("error_bands.json")
CLASSES = ("timm vision", "Transformers text", "Transformers vision/other")
ANY = "any model"
"""The band of every class together: presets, factories, and a class with too few rows of its own."""
TEXT_TASKS = ("causal-lm", "masked-lm", "seq2seq-lm")
WIDEN = 2.0
"""Outside the measured torch releases or GPU architecture, both ends of the band are this many times as
wide: a rule of caution, not a measurement."""
CONTEXT_GIB = 2.1
"""Each process's CUDA context, cuBLAS handles and NCCL's buffers, outside the caching allocator: up to
2.06 GiB per process on an H100 (torch 2.11; the population's nvml_used_gib over peak_reserved_gib)."""
RESERVE_FRACTION = 0.02
"""What the caching allocator holds reserved but unallocated when memory runs short: 0.7-1.5 % of the
allocated peak when an H200 ran out (results/oom_probe-h200)."""
COMPUTE_CAPABILITY = {
    "H100": "9.0", "H200": "9.0", "GH200": "9.0", "H800": "9.0", "H20": "9.0",
    "B200": "10.0", "B100": "10.0", "GB200": "10.0",
    "A100": "8.0", "A800": "8.0", "A30": "8.0", "A10": "8.6", "A40": "8.6", "RTX 3090": "8.6",
    "L4": "8.9", "L40": "8.9", "RTX 4090": "8.9", "V100": "7.0", "T4": "7.5",
}  # fmt: skip
"""GPU names (as torch and nvidia-smi spell them, or the part a user types) to compute capability."""


@dataclass(frozen=True)
class Band:
    """measured/predicted − 1 of a class's rows: `lower` (over-prediction, ≤ 0) to `upper` (≥ 0)."""

    name: str
    lower: float
    upper: float
    rows: int
    widened: str = ""
    """Why it is wider than measured ("" where it holds as measured)."""

    def high_gib(self, peak_gib: float) -> float:
        return peak_gib * (1 + self.upper)

    def low_gib(self, peak_gib: float) -> float:
        return peak_gib * (1 + self.lower)

    def over(self, predicted: Callable[[int], Optional[float]]) -> Callable[[int], Optional[float]]:
        """`predicted` (a size to a peak in GiB, or None) at the band's upper end."""

        def high(value: int) -> Optional[float]:
            peak = predicted(value)
            return None if peak is None else self.high_gib(peak)

        return high

    def holds(self, ratio: float) -> bool:
        """Whether a measured/predicted ratio lies inside the band."""
        return 1 + self.lower <= ratio <= 1 + self.upper

    def __str__(self) -> str:
        text = f"{self.lower:+.1%}/{self.upper:+.1%} ({self.name}, {self.rows} rows"
        return text + (f"; widened x{WIDEN:g}: {self.widened})" if self.widened else ")")


def needed_gib(high_gib: float) -> float:
    """A GPU's memory the step needs: the peak at its band's upper end (Band.high_gib; a row's
    predicted_peak_high_gib), the allocator's reserve and the CUDA context."""
    return high_gib * (1 + RESERVE_FRACTION) + CONTEXT_GIB


def class_of(kind: Optional[str], task: Optional[str]) -> str:
    """A model's class from its source's kind (hf, timm, preset, factory) and task."""
    if kind == "timm":
        return CLASSES[0]
    if kind == "hf":
        return CLASSES[1] if task in TEXT_TASKS else CLASSES[2]
    return ANY


def class_of_info(model) -> str:
    """class_of a model's description (models.describe.ModelInfo)."""
    return class_of(getattr(model, "kind", None), getattr(model, "task", None))


def class_of_model(model: str, task: Optional[str] = None) -> str:
    """class_of from the experiment's model string (a row's `model`): rows of earlier versions say no kind."""
    kind = "timm" if model.startswith("timm:") else "hf" if model.startswith("hf:") else None
    if kind == "hf" and task is None:
        return ANY  # text or not is the task's, which such a row does not say
    return class_of(kind, task)


@lru_cache(maxsize=1)
def measured() -> dict:
    """error_bands.json: each class's band, and where it was measured."""
    return json.loads(BANDS_FILE.read_text())


def band_for(name: str, gpu: Optional[str] = None, torch_version: Optional[str] = None) -> Band:
    """The band of class `name`, widened where `gpu` (a name; None: not named) or the torch version
    (default: the running one) lies outside what the population measured."""
    table = measured()
    found = table["classes"].get(name) or table["classes"][ANY]
    why = [*_outside_torch(table["about"], torch_version), *_outside_gpu(table["about"], gpu)]
    if not why:
        return Band(found["name"], found["lower"], found["upper"], found["rows"])
    return Band(found["name"], found["lower"] * WIDEN, found["upper"] * WIDEN, found["rows"], "; ".join(why))


def _outside_torch(about: dict, version: Optional[str]) -> list[str]:
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return ["torch is not installed"]
    release = Version(version).release[:2]
    low, high = (Version(v).release[:2] for v in about["torch_range"])
    if low <= release <= high:
        return []
    return [f"torch {version} is outside the measured {about['torch_range'][0]}-{about['torch_range'][1]}"]


def compute_capability(gpu: str) -> Optional[str]:
    """The compute capability of a GPU named as torch, nvidia-smi or a user spells it; None if unknown."""
    words = gpu.upper().replace("-", " ").split()
    spelled = " ".join(w for w in words if w not in ("NVIDIA", "TESLA", "GEFORCE"))
    for name in sorted(COMPUTE_CAPABILITY, key=len, reverse=True):
        if (
            spelled == name
            or spelled.startswith(name + " ")
            or spelled.replace(" ", "") == name.replace(" ", "")
        ):
            return COMPUTE_CAPABILITY[name]
    return None


def _outside_gpu(about: dict, gpu: Optional[str]) -> list[str]:
    if gpu is None or gpu == "cpu":
        return []
    capability = compute_capability(gpu)
    if capability in about["compute_capabilities"]:
        return []
    measured_on = ", ".join(about["gpus"])
    if capability is None:
        return [f"{gpu}: an unknown GPU architecture (measured on {measured_on})"]
    return [f"{gpu} is compute capability {capability}, the band's {measured_on} "
            f"{'/'.join(about['compute_capabilities'])}"]  # fmt: skip
