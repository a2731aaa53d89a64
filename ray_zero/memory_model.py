"""Predicted memory per rank for ZeRO stages 0-3: the ZeRO paper's formula and what DeepSpeed allocates.

Pure arithmetic on the parameter count Ψ, the number of data-parallel ranks N, the precision and
the model's shapes. Two formulas, always labelled:

* ``paper``: Rajbhandari et al. 2020, mixed-precision Adam: 2Ψ (fp16 params) + 2Ψ (fp16 grads) + KΨ
  optimizer states with K = 12 (fp32 master 4 + momentum 4 + variance 4); stage 1 divides the KΨ by N,
  stage 2 also the gradients, stage 3 also the parameters. In fp32 training K = 8 and params/grads
  take 4 bytes each. Model states only.
* ``deepspeed``: the tensors DeepSpeed 0.19.8 really keeps (read from its optimizers' code and checked
  against the tensors counted and the peaks measured, see README "Where the memory goes"), plus the
  temporaries of the optimizer step, the reduce bucket and the activations of one micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ray_zero.sizes import PRESETS, ModelPreset

GIB = 1024 ** 3
BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


# cuBLAS and cuBLASLt workspaces that torch allocates through its caching allocator at the first
# matmul: 64 MiB, measured on an H200 with torch 2.11 (allocated memory after the first backward of
# the 0.27 M-parameter seed model, less its gradients and data). Zero on CPU.
CUDA_WORKSPACE_BYTES = 64 * 1024 ** 2


@dataclass(frozen=True)
class Prediction:
    """Predicted bytes on one rank, per component."""

    formula: str
    parameter_bytes: float
    gradient_bytes: float
    master_param_bytes: float
    optimizer_state_bytes: float
    bucket_bytes: float = 0.0
    """ZeRO's reduce bucket (stage >= 1): allocated at its full configured size, whatever the model."""
    step_transient_bytes: float = 0.0
    """Temporaries that live only inside the optimizer step (e.g. fp32 copies of gradients)."""
    activation_bytes: float = 0.0
    """Tensors saved for backward for one micro-batch."""
    workspace_bytes: float = 0.0
    """The CUDA libraries' workspaces (GPU only)."""
    data_bytes: float = 0.0
    """This rank's shard of the dataset, which ray_zero keeps on the device."""

    @property
    def model_state_bytes(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.master_param_bytes + self.optimizer_state_bytes

    @property
    def peak_bytes(self) -> float:
        # Activations are freed by the end of backward; the step's temporaries come after.
        return (self.model_state_bytes + self.bucket_bytes + self.workspace_bytes + self.data_bytes
                + max(self.activation_bytes, self.step_transient_bytes))


def paper(params: int, stage: int, num_workers: int, precision: str = "fp16") -> Prediction:
    """The ZeRO paper's model states per rank (no activations, buffers or temporaries)."""
    n = num_workers
    low = BYTES[precision]
    master = 4.0 * params if precision != "fp32" else 0.0
    states = 8.0 * params
    grads = float(low * params)
    weights = float(low * params)
    if stage >= 1:
        master, states = master / n, states / n
    if stage >= 2:
        grads /= n
    if stage >= 3:
        weights /= n
    return Prediction("paper", weights, grads, master, states)


def activation_bytes(preset: ModelPreset, micro_batch_size: int, precision: str) -> float:
    """Saved activations of one micro-batch: Korthikanti et al. 2022's per-layer count, generalised
    to a feed-forward width f: s*b*(18h + 4f) + 5*a*s^2*b bytes at 16 bits (34sbh when f = 4h)."""
    s, b, h, f, a = preset.num_patches, micro_batch_size, preset.dim, preset.ff_dim, preset.heads
    per_layer_16bit = s * b * (18 * h + 4 * f) + 5 * a * s * s * b
    return preset.depth * per_layer_16bit * BYTES[precision] / 2


def deepspeed(params: int, stage: int, num_workers: int, precision: str, *,
              micro_batch_size: int = 1, preset: ModelPreset | None = None,
              reduce_bucket_size: int = 50_000_000, on_gpu: bool = True, data_bytes: float = 0.0) -> Prediction:
    """What DeepSpeed 0.19.8 allocates per rank with torch Adam(W).

    Checked on H200 (fp16; README "Where the memory goes"); bf16 and fp32 follow the same code paths
    as read in DeepSpeed's source, and stage 3 uses the paper's split: neither is checked on a GPU yet.

    Stage 0, fp16 (FP16_Optimizer): fp16 params and grads, a flat fp32 master, Adam's two states
    (created by initialize); its step makes an fp32 copy of every gradient and then a flat fp32
    gradient: 8Ψ of temporaries, which is why stage 0 peaks near 24 bytes per parameter, not 16.
    Stage 0, bf16 (BF16_Optimizer): bf16 params and grads, a flat fp32 gradient accumulator, fp32 master.
    Stage 0, fp32: torch AdamW on the module's own parameters; its foreach step needs one fp32 temporary.
    Stages 1 and 2 (DeepSpeedZeroOptimizer): both reduce gradients into this rank's partition, so in
    0.19.8 stage 1 holds what stage 2 holds: full low-precision params; a low-precision gradient
    partition; the fp32 master partition and Adam's states; in the step a flat copy of the gradient
    partition and its fp32 copy (so 2Ψ + 20Ψ/N at fp16); plus the reduce bucket.
    """
    n = num_workers
    low = BYTES[precision]
    psi = float(params)
    bucket = 0.0 if stage == 0 else float(low * reduce_bucket_size)
    if stage == 0:
        if precision == "fp16":
            parts = dict(parameter_bytes=2 * psi, gradient_bytes=2 * psi, master_param_bytes=4 * psi,
                         optimizer_state_bytes=8 * psi, step_transient_bytes=8 * psi)
        elif precision == "bf16":
            parts = dict(parameter_bytes=2 * psi, gradient_bytes=(2 + 4) * psi, master_param_bytes=4 * psi,
                         optimizer_state_bytes=8 * psi, step_transient_bytes=4 * psi)
        else:
            parts = dict(parameter_bytes=4 * psi, gradient_bytes=4 * psi, master_param_bytes=0.0,
                         optimizer_state_bytes=8 * psi, step_transient_bytes=4 * psi)
    elif stage in (1, 2):
        # In fp32 the ".to(fp32)" of the flat gradient is the same tensor: no second copy.
        transient = (low + (4 if precision != "fp32" else 0)) * psi / n
        parts = dict(parameter_bytes=low * psi, gradient_bytes=low * psi / n, master_param_bytes=4 * psi / n,
                     optimizer_state_bytes=8 * psi / n, step_transient_bytes=transient)
    else:
        base = paper(params, 3, n, precision)
        parts = dict(parameter_bytes=base.parameter_bytes, gradient_bytes=base.gradient_bytes,
                     master_param_bytes=base.master_param_bytes, optimizer_state_bytes=base.optimizer_state_bytes)
    return Prediction("deepspeed", bucket_bytes=bucket,
                      activation_bytes=activation_bytes(preset, micro_batch_size, precision) if preset else 0.0,
                      workspace_bytes=CUDA_WORKSPACE_BYTES if on_gpu else 0.0, data_bytes=data_bytes, **parts)


def predict_row(model: str, stage: int, num_workers: int, precision: str, micro_batch_size: int,
                reduce_bucket_size: int = 50_000_000, on_gpu: bool = True, data_bytes: float = 0.0) -> dict[str, float]:
    """The prediction columns of a results row (GiB)."""
    preset = PRESETS[model]
    params = preset.param_count()
    real = deepspeed(params, stage, num_workers, precision, micro_batch_size=micro_batch_size, preset=preset,
                     reduce_bucket_size=reduce_bucket_size, on_gpu=on_gpu, data_bytes=data_bytes)
    book = paper(params, stage, num_workers, precision)
    return {
        "predicted_model_state_gib": real.model_state_bytes / GIB,
        "predicted_peak_gib": real.peak_bytes / GIB,
        "paper_model_state_gib": book.model_state_bytes / GIB,
    }
