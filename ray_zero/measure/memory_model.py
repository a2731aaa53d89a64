"""Predicted memory per rank for a results row: the engine's model states (ray_zero/measure/engine_memory.py)
plus what one micro-batch adds (its activations and the step's transients), the CUDA workspaces and the
rank's data.

What a micro-batch adds: the point's step traced on the meta device before any run (the row's
`traced_activation_bytes`, ray_zero/train/grid_trace.py); where it could not be traced, the presets'
shapes (Korthikanti et al. 2022) or the bytes per sample a calibration measured
(ray_zero/measure/calibration.py).
"""

from __future__ import annotations

from typing import Any, Optional

from ray_zero.config import DEFAULT_BUCKET_ELEMENTS
from ray_zero.measure.calibration import lookup
from ray_zero.measure.engine_memory import engine_prediction
from ray_zero.measure.partitions import Held
from ray_zero.measure.prediction import BYTES, Prediction
from ray_zero.models.presets import PRESETS, SAMPLE_BYTES, ModelPreset
from ray_zero.models.spec import SYNTHETIC_BATCHES

HELD_COLUMNS = (
    "param_elements_per_rank",
    "gradient_elements_per_rank",
    "state_elements_per_rank",
    "trainable_params",
    "step_group_elements_per_rank",
)
"""Row fields (trial_row) of what the fullest rank holds, in elements (ray_zero.measure.partitions.Held);
the last is blank where the whole partition is stepped at once, and in rows of earlier versions."""
# cuBLAS and cuBLASLt workspaces that torch allocates through its caching allocator at the first matmul:
# 64 MiB, measured on an H200 with torch 2.11. Zero on CPU.
CUDA_WORKSPACE_BYTES = 64 * 1024**2


def preset_activation_bytes(
    preset: ModelPreset, micro_batch_size: int, precision: str, checkpointing: bool = False
) -> float:
    """Saved activations of one micro-batch of a preset: Korthikanti et al. 2022's per-layer count,
    generalised to a feed-forward width f: s*b*(18h + 4f) + 5*a*s^2*b bytes at 16 bits (34sbh when f = 4h).
    With checkpointing: each block's input (2sbh at 16 bits) plus one block's activations, recomputed."""
    s, b, h, f, a = preset.num_patches, micro_batch_size, preset.dim, preset.ff_dim, preset.heads
    per_layer = s * b * (18 * h + 4 * f) + 5 * a * s * s * b
    scale = BYTES[precision] / 2
    if checkpointing:
        return (preset.depth * 2 * s * b * h + per_layer) * scale
    return preset.depth * per_layer * scale


def held_in_row(row: dict[str, Any]) -> Optional[Held]:
    """The elements the fullest rank holds, as trial_row recorded them (None in rows of earlier versions)."""
    values = [row.get(key) for key in HELD_COLUMNS]
    if not all(isinstance(v, (int, float)) for v in values[:-1]):
        return None
    return Held(*values[:-1], step_group=values[-1] if isinstance(values[-1], (int, float)) else None)


def activation_estimate(
    row: dict[str, Any], calibration: Optional[dict], traced: bool = True
) -> tuple[Optional[float], str]:
    """Bytes one micro-batch adds to the rank's memory, and where the figure comes from: the point's traced
    step (`traced_activation_bytes`, ray_zero/train/grid_trace.py; unless `traced` is False), the
    presets' shapes, or the calibration of this engine (ray_zero/measure/calibration.py; "(doubtful: ...)"
    when its fit is)."""
    figure = row.get("traced_activation_bytes")
    if traced and isinstance(figure, (int, float)) and not isinstance(figure, bool):
        return float(figure), "activations traced"
    model, micro = row["model"], row["micro_batch_size"]
    checkpointing = bool(row.get("activation_checkpointing"))
    if model in PRESETS:
        return preset_activation_bytes(
            PRESETS[model], micro, row["precision"], checkpointing
        ), "preset shapes"
    backend = row.get("backend", "deepspeed")
    per_sample, source = lookup(calibration, backend, checkpointing, row.get("seq_len"))
    if per_sample is None:
        return None, source
    return per_sample * micro, source


def synthetic_data_bytes(row: dict[str, Any]) -> Optional[float]:
    """What a rank's synthetic data holds on its device (its SYNTHETIC_BATCHES micro-batches, made once);
    None where the row does not say a sample's bytes or the data is not synthetic."""
    sample = row.get("sample_bytes")
    if row.get("dataset") != "synthetic" or not isinstance(sample, (int, float)):
        return None
    return float(SYNTHETIC_BATCHES * row["micro_batch_size"] * sample)


def engine_for_row(row: dict[str, Any]) -> Prediction:
    """The engine's model states, buckets and step temporaries for a results row (activations aside)."""
    on_gpu = row.get("memory_kind") == "cuda"
    return engine_prediction(
        row["backend"],
        row["params"],
        row["stage"],
        row["num_workers"],
        row["precision"],
        # Offload moves the master and Adam's states from the device to the host: on a CPU rank both are
        # the same memory, where the rank's count finds them.
        offload=row.get("offload_optimizer", "none") if on_gpu else "none",
        reduce_bucket_size=row.get("reduce_bucket_size", DEFAULT_BUCKET_ELEMENTS),
        largest_block_params=row.get("largest_block_params"),
        held=held_in_row(row),
    )


def predict_point(row: dict[str, Any], calibration: Optional[dict] = None, traced: bool = True) -> Prediction:
    """The prediction for a results row (its point, model, precision and device): made once, when the row
    is made (ray_zero/rows.py), and stored in it. `traced` False: the calibrated (or preset) activations
    even where the row was traced, for the side-by-side check."""
    prediction = engine_for_row(row)
    if row.get("memory_kind") != "cuda":  # CPU rows: the model states compare with the tensors counted
        return Prediction(
            **{**prediction.__dict__, "activation_bytes": None, "basis": "model states only (CPU)"}
        )
    activations, source = activation_estimate(row, calibration, traced)
    data = synthetic_data_bytes(row)
    if data is None:  # rows of earlier versions: what the rank held, or the presets' samples
        data = row.get("data_bytes_per_rank_max")
    if not isinstance(data, (int, float)):
        data = (
            SYNTHETIC_BATCHES * row["micro_batch_size"] * SAMPLE_BYTES
            if row["model"] in PRESETS and row.get("dataset") == "synthetic"
            else 0.0
        )
    compute = prediction.compute_bytes
    if source == "activations traced" and row["backend"] == "torch_zero":
        compute = 0.0  # autocast's low-precision copies of the weights are in the traced step
    basis = prediction.basis
    if row.get("activation_checkpointing") and basis.startswith("checked"):
        basis = "unchecked (activation checkpointing)"
    if source != "preset shapes":  # the activations' source stays in the basis (the row's activation_source)
        basis = f"{basis}; {source}"
    return Prediction(
        **{
            **prediction.__dict__,
            "activation_bytes": activations,
            "compute_bytes": compute,
            "workspace_bytes": CUDA_WORKSPACE_BYTES,
            "data_bytes": float(data),
            "basis": basis if activations is not None else source,
        }
    )
