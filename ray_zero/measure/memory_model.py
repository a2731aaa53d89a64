"""Predicted memory per rank: the ZeRO paper's formula, and what each engine really allocates.

Pure arithmetic on the parameter count Ψ, the number of data-parallel ranks N, the precision and the
activations of one micro-batch; where the parameters' shapes are known (ray_zero/partitions.py, rows
made by trial_row), on the elements each engine really leaves on its fullest rank instead of Ψ/N:
frozen parameters, DeepSpeed's padding and ZeRO-3's persistent small parameters, the tensors ZeRO-1/2
gradient buffers keep whole, ZeroRedundancyOptimizer's whole-tensor split, FSDP2's padded dim 0.
Every formula is labelled with what it counts and where it was checked (`Prediction.basis`;
"unchecked" where no GPU has measured it yet):

* `paper`: Rajbhandari et al. 2020, mixed-precision Adam: 2Ψ (fp16 params) + 2Ψ (fp16 grads) + 12Ψ
  (fp32 master 4 + momentum 4 + variance 4); stage 1 divides the 12Ψ by N, stage 2 the gradients too,
  stage 3 the parameters too. fp32 training: 4Ψ + 4Ψ + 8Ψ. Model states only.
* `deepspeed`: DeepSpeed 0.19.8's tensors (read from its optimizers' code), the optimizer step's
  temporaries, the reduce bucket; ZeRO-Offload keeps master weights and Adam's states in CPU memory.
* `torch_zero`: DDP + ZeroRedundancyOptimizer over fp32 parameters, autocast for fp16/bf16.
* `fsdp`: FSDP2's shards, plus the parameters it gathers to compute.
Activations: Korthikanti et al. 2022's count for the presets' shapes; for any other model, the bytes a
calibration trial measured per sample (ray_zero/calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ray_zero.measure.calibration import lookup
from ray_zero.measure.partitions import Held, even
from ray_zero.models.presets import PRESETS, SAMPLE_BYTES, ModelPreset

GIB = 1024**3
HELD_COLUMNS = (
    "param_elements_per_rank",
    "gradient_elements_per_rank",
    "state_elements_per_rank",
    "trainable_params",
)
"""Row fields (trial_row) of what the fullest rank holds, in elements (ray_zero.measure.partitions.Held)."""
BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
# cuBLAS and cuBLASLt workspaces that torch allocates through its caching allocator at the first matmul:
# 64 MiB, measured on an H200 with torch 2.11. Zero on CPU.
CUDA_WORKSPACE_BYTES = 64 * 1024**2
CHECKED = "checked on H200 (fp16, stages 0-1, 1-2 GPUs, 806 M preset, within 1%)"
CHECKED_ONE_GPU = "checked on 1 H200 (806 M preset, within 1%)"
OFFLOAD_CHECKED = (
    "checked on 1 H200 (806 M preset, fp16): the backward's transients are not counted "
    "(measured 1.10x the prediction at stage 2, 1.20x at stage 1)"
)
ENGINE_CHECKED = "checked on 1 H200 (806 M preset, fp16, within 1%)"
"""Where the DeepSpeed formula met a GPU: fp16 stages 0-1 on 1 and 2 H200s; fp16 stages 2-3 and bf16
stages 0-3 on one (results/large_*-h200)."""


@dataclass(frozen=True)
class Prediction:
    """Predicted bytes on one rank, per component."""

    formula: str
    parameter_bytes: float
    gradient_bytes: float
    master_param_bytes: float
    optimizer_state_bytes: float
    bucket_bytes: float = 0.0
    """Communication buffers: ZeRO's reduce bucket (allocated at its configured size whatever the model),
    DDP's gradient buckets."""
    step_transient_bytes: float = 0.0
    """Temporaries that live only inside the optimizer step (e.g. fp32 copies of gradients)."""
    compute_bytes: float = 0.0
    """Parameters gathered or cast for compute while activations live: FSDP2's unsharded blocks,
    autocast's low-precision weight copies."""
    activation_bytes: Optional[float] = 0.0
    """Tensors saved for backward for one micro-batch; None when unknown (no calibration)."""
    workspace_bytes: float = 0.0
    data_bytes: float = 0.0
    """This rank's data on the device (MNIST shard or synthetic batches)."""
    gradients_freed_in_step: bool = False
    """The optimizer frees the gradients after its step (zero_grad(set_to_none), DeepSpeed's stages 0-2),
    so they are not allocated while the next forward's activations peak: measured per phase on an H200,
    memory after the first step fell by the gradients' bytes for DeepSpeed stages 0-2, DDP and FSDP2, while
    ZeRO-3 allocates its gradient partition once, at initialize."""
    basis: str = "unchecked"
    """On what this formula was checked."""

    @property
    def model_state_bytes(self) -> float:
        return (
            self.parameter_bytes + self.gradient_bytes + self.master_param_bytes + self.optimizer_state_bytes
        )

    @property
    def peak_bytes(self) -> Optional[float]:
        if self.activation_bytes is None:
            return None
        # Activations peak at the end of the forward (before the gradients where the step freed them) and
        # are freed by the end of backward; the step's temporaries come after.
        forward = (
            self.activation_bytes
            + self.compute_bytes
            - (self.gradient_bytes if self.gradients_freed_in_step else 0.0)
        )
        return (
            self.model_state_bytes
            + self.bucket_bytes
            + self.workspace_bytes
            + self.data_bytes
            + max(forward, self.step_transient_bytes)
        )


def paper(params: int, stage: int, num_workers: int, precision: str = "fp16") -> Prediction:
    """The ZeRO paper's model states per rank (no activations, buffers or temporaries)."""
    n, low = num_workers, BYTES[precision]
    master = 4.0 * params if precision != "fp32" else 0.0
    states, grads, weights = 8.0 * params, float(low * params), float(low * params)
    if stage >= 1:
        master, states = master / n, states / n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        weights /= n
    return Prediction("paper", weights, grads, master, states, basis="the ZeRO paper's formula")


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


def deepspeed(
    params: int,
    stage: int,
    num_workers: int,
    precision: str,
    *,
    offload: str = "none",
    reduce_bucket_size: int = 50_000_000,
    held: Optional[Held] = None,
) -> Prediction:
    """What DeepSpeed 0.19.8 allocates per rank with torch Adam(W), activations aside. `held`: the
    elements its fullest rank holds (ray_zero/partitions.py, from the parameters' shapes: frozen ones, the
    tensors its partitions cut, ZeRO-3's persistent ones); None: an even split, everything trainable.

    Stage 0, fp16 (FP16_Optimizer): fp16 params and grads, a flat fp32 master, Adam's two states; its step
    makes an fp32 copy of every gradient and then a flat fp32 gradient: 8Ψ of temporaries, which is why
    stage 0 peaks near 24 bytes per parameter, not 16. bf16 takes the same optimizer (DDP_BFLOAT16: with
    gradients accumulated in bf16, DeepSpeed's default, there is no fp32 accumulator; GPT-2 and the 1.1 B
    Llama measured the fp16 bytes in every phase on one H200). fp32: torch AdamW on the module's own
    parameters, whose foreach step needs one fp32 temporary.
    Stages 1 and 2 (DeepSpeedZeroOptimizer) both reduce gradients into this rank's partition, so in 0.19.8
    stage 1 holds what stage 2 holds: full low-precision params, a low-precision gradient buffer (the
    tensors that overlap its partition, whole), the fp32 master partition and Adam's states, and in the
    step a flat copy of the gradient partition and its fp32 copy (2Ψ + 20Ψ/N at fp16), plus the reduce
    bucket. With offload the master and Adam's states live in CPU memory and the step runs there.
    Stage 3: everything /N, as the paper's split, plus an fp32 master partition also in fp32 training;
    parameters of at most `param_persistence_threshold` (1e5) elements also stay whole on every rank.
    Frozen parameters are cast and partitioned like the others, with no gradient, master or states.
    """
    n, low = num_workers, BYTES[precision]
    h = held or even(params, "deepspeed", stage, n)
    bucket = 0.0 if stage == 0 else float(low * reduce_bucket_size)
    basis = "unchecked"
    if offload == "none" and precision == "fp16" and stage in (0, 1):
        basis = CHECKED
    elif offload == "none" and precision in ("fp16", "bf16") and n == 1:
        basis = CHECKED_ONE_GPU
    if stage == 0:
        if precision in ("fp16", "bf16"):
            parts = dict(
                parameter_bytes=2 * h.params,
                gradient_bytes=2 * h.gradients,
                master_param_bytes=4 * h.states,
                optimizer_state_bytes=8 * h.states,
                step_transient_bytes=8 * h.states,
            )
        else:
            parts = dict(
                parameter_bytes=4 * h.params,
                gradient_bytes=4 * h.gradients,
                master_param_bytes=0.0,
                optimizer_state_bytes=8 * h.states,
                step_transient_bytes=4 * h.states,
            )
    elif stage in (1, 2):
        # In fp32 the ".to(fp32)" of the flat gradient is the same tensor: no second copy.
        transient = (low + (4 if precision != "fp32" else 0)) * h.states
        parts = dict(
            parameter_bytes=low * h.params,
            gradient_bytes=low * h.gradients,
            master_param_bytes=4 * h.states,
            optimizer_state_bytes=8 * h.states,
            step_transient_bytes=transient,
        )
    else:  # the paper's split, with an fp32 master partition in fp32 training too (DeepSpeed keeps one);
        # its step peaks 8 bytes per parameter (of this rank's partition) above the states, as stage 0's
        # (measured at 1 GPU, fp16 and bf16: 24.2 bytes per parameter at the peak).
        parts = dict(
            parameter_bytes=low * h.params,
            gradient_bytes=low * h.gradients,
            master_param_bytes=4 * h.states,
            optimizer_state_bytes=8 * h.states,
            step_transient_bytes=(8 if precision != "fp32" else 4) * h.states,
        )
    if offload != "none":
        # In CPU memory, not on the device: the master, Adam's states, the step, and (measured on one H200,
        # 806 M preset: +0.06 GiB over the first backward) the gradient partition, which each reduce copies
        # to an fp32 host buffer. The backward's transients above the saved activations are not counted
        # (+0.2 GiB at stage 2, +0.5 GiB at stage 1 on that model, where they set the peak).
        parts.update(
            gradient_bytes=0.0, master_param_bytes=0.0, optimizer_state_bytes=0.0, step_transient_bytes=0.0
        )
        basis = OFFLOAD_CHECKED if precision == "fp16" and n == 1 and stage in (1, 2) else "unchecked"
    return Prediction(
        "deepspeed", bucket_bytes=bucket, basis=basis, gradients_freed_in_step=stage < 3, **parts
    )


def torch_zero(
    params: int, stage: int, num_workers: int, precision: str, held: Optional[Held] = None
) -> Prediction:
    """DDP (+ ZeroRedundancyOptimizer at stage 1) over fp32 parameters: fp32 params and grads (of the
    trainable ones), DDP's gradient buckets (another fp32 copy of the gradients: gradient_as_bucket_view
    is off), Adam's states (at stage 1 of the whole tensors ZeroRedundancyOptimizer gives the fullest
    rank, `held.states`; about 1/N on a model of many similar tensors), autocast's low-precision weight
    copies while the micro-batch's activations live, and the foreach step's fp32 temporary of the states
    it steps."""
    n, psi = num_workers, float(params)
    h = held or even(params, "torch_zero", stage, n)
    # DDP allocates its buckets at any world size: one H200 measured +3.0 GiB (4Ψ) at the wrap, 18.08 GiB
    # peak.
    return Prediction(
        "torch_zero",
        parameter_bytes=4 * h.params,
        gradient_bytes=4 * h.gradients,
        master_param_bytes=0.0,
        gradients_freed_in_step=True,
        optimizer_state_bytes=8 * h.states,
        bucket_bytes=4 * h.trainable,
        step_transient_bytes=4 * h.states,
        compute_bytes=2 * psi if precision != "fp32" else 0.0,
        basis=ENGINE_CHECKED if n == 1 and precision == "fp16" else "unchecked",
    )


def fsdp(
    params: int,
    stage: int,
    num_workers: int,
    precision: str,
    largest_block_params: float,
    held: Optional[Held] = None,
) -> Prediction:
    """FSDP2: fp32 parameters, gradients and Adam's states sharded N ways (each tensor's first dimension,
    padded: `held`); to compute it gathers the parameters in the compute dtype: stage 3 one block at a
    time (two with prefetch), stage 2 keeps every block gathered from its forward to its backward."""
    n, psi, low = num_workers, float(params), BYTES[precision]
    h = held or even(params, "fsdp", stage, n)
    gathered = low * psi if stage == 2 else 2 * low * largest_block_params
    # At one rank too in fp16/bf16: the unsharded parameters are low-precision copies (calibration's
    # intercept on an H200: 2.0 GiB for a 1.1 B model at stage 2, its bf16 weights); fp32 at one rank
    # computes on the shard itself.
    return Prediction(
        "fsdp",
        parameter_bytes=4 * h.params,
        gradient_bytes=4 * h.gradients,
        master_param_bytes=0.0,
        optimizer_state_bytes=8 * h.states,
        step_transient_bytes=4 * h.states,
        compute_bytes=gathered if n > 1 or precision != "fp32" else 0.0,
        gradients_freed_in_step=True,
        basis=ENGINE_CHECKED if n == 1 and precision == "fp16" else "unchecked",
    )


def engine_prediction(
    backend: str,
    params: int,
    stage: int,
    num_workers: int,
    precision: str,
    *,
    offload: str = "none",
    reduce_bucket_size: int = 50_000_000,
    largest_block_params: Optional[float] = None,
    held: Optional[Held] = None,
) -> Prediction:
    """The engine's prediction; `held` from ray_zero/partitions.py when the parameters' shapes are known."""
    if backend == "deepspeed":
        return deepspeed(
            params,
            stage,
            num_workers,
            precision,
            offload=offload,
            reduce_bucket_size=reduce_bucket_size,
            held=held,
        )
    if backend == "torch_zero":
        return torch_zero(params, stage, num_workers, precision, held)
    return fsdp(params, stage, num_workers, precision, largest_block_params or params, held)


def held_in_row(row: dict[str, Any]) -> Optional[Held]:
    """The elements the fullest rank holds, as trial_row recorded them (None in rows of earlier versions)."""
    values = [row.get(key) for key in HELD_COLUMNS]
    return Held(*values) if all(isinstance(v, (int, float)) for v in values) else None


def activation_estimate(
    model: str,
    micro_batch_size: int,
    precision: str,
    checkpointing: bool,
    calibration: Optional[dict],
    backend: str = "deepspeed",
) -> tuple[Optional[float], str]:
    """Bytes one micro-batch keeps for backward, and where the figure comes from: the presets' shapes, or
    the calibration of this engine (ray_zero/calibration.py; "(doubtful: ...)" when its fit is)."""
    if model in PRESETS:
        return preset_activation_bytes(
            PRESETS[model], micro_batch_size, precision, checkpointing
        ), "preset shapes"
    per_sample, source = lookup(calibration, backend, checkpointing)
    if per_sample is None:
        return None, source
    return per_sample * micro_batch_size, source


def predict_point(row: dict[str, Any], calibration: Optional[dict] = None) -> Prediction:
    """The prediction for a results row (its point, model, precision and device)."""
    on_gpu = row.get("memory_kind") == "cuda"
    prediction = engine_prediction(
        row["backend"],
        row["params"],
        row["stage"],
        row["num_workers"],
        row["precision"],
        offload=row.get("offload_optimizer", "none"),
        reduce_bucket_size=row.get("reduce_bucket_size", 50_000_000),
        largest_block_params=row.get("largest_block_params"),
        held=held_in_row(row),
    )
    if not on_gpu:  # CPU rows: the model states are comparable with the tensors counted; the peak is not
        return Prediction(
            **{**prediction.__dict__, "activation_bytes": None, "basis": "model states only (CPU)"}
        )
    activations, source = activation_estimate(
        row["model"],
        row["micro_batch_size"],
        row["precision"],
        bool(row.get("activation_checkpointing")),
        calibration,
        row["backend"],
    )
    data = row.get("data_bytes_per_rank_max")
    if not isinstance(data, (int, float)):
        data = (
            4 * row["micro_batch_size"] * SAMPLE_BYTES
            if row["model"] in PRESETS and row.get("dataset") == "synthetic"
            else 0.0
        )
    basis = prediction.basis if source == "preset shapes" else f"{prediction.basis}; {source}"
    if row.get("activation_checkpointing") and basis.startswith("checked"):
        basis = "unchecked (activation checkpointing)"
    return Prediction(
        **{
            **prediction.__dict__,
            "activation_bytes": activations,
            "workspace_bytes": CUDA_WORKSPACE_BYTES,
            "data_bytes": float(data),
            "basis": basis if activations is not None else "no calibration",
        }
    )
