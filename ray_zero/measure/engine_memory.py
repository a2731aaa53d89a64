"""What each engine allocates per rank, activations aside, and the ZeRO paper's formula beside them.

Pure arithmetic on the parameter count Ψ, the number of data-parallel ranks N and the precision; where the
parameters' shapes are known (ray_zero/measure/partitions.py, rows made by trial_row), on the elements each
engine really leaves on its fullest rank instead of Ψ/N: frozen parameters, DeepSpeed's padding and
ZeRO-3's persistent small parameters, the tensors ZeRO-1/2 gradient buffers keep whole,
ZeroRedundancyOptimizer's whole-tensor split, FSDP2's padded dim 0.
Every formula is labelled with what it counts and where it was checked (`Prediction.basis`;
"unchecked" where no GPU has measured it yet):

* `paper`: Rajbhandari et al. 2020, mixed-precision Adam: 2Ψ (fp16 params) + 2Ψ (fp16 grads) + 12Ψ
  (fp32 master 4 + momentum 4 + variance 4); stage 1 divides the 12Ψ by N, stage 2 the gradients too,
  stage 3 the parameters too. fp32 training: 4Ψ + 4Ψ + 8Ψ. Model states only.
* `deepspeed`: DeepSpeed 0.19.8's tensors (read from its optimizers' code), the optimizer step's
  temporaries, the reduce bucket; ZeRO-Offload keeps master weights and Adam's states in CPU memory.
* `torch_zero`: DDP + ZeroRedundancyOptimizer over fp32 parameters, autocast for fp16/bf16.
* `fsdp`: FSDP2's shards, plus the parameters it gathers to compute.
"""

from __future__ import annotations

from typing import Optional

from ray_zero.config import DEFAULT_BUCKET_ELEMENTS, registered
from ray_zero.measure.partitions import Held, even
from ray_zero.measure.prediction import BYTES, Prediction

CHECKED = "checked on H200 (fp16, stages 0-1, 1-2 GPUs, 806 M preset, within 1%)"
CHECKED_ONE_GPU = "checked on 1 H200 (806 M preset, within 1%)"
OFFLOAD_CHECKED = (
    "checked on 1 H200 (806 M preset, fp16): the backward's transients are not counted "
    "(measured 1.10x the prediction at stage 2, 1.20x at stage 1)"
)
ENGINE_CHECKED = "checked on 1 H200 (806 M preset, fp16, within 1%)"
"""Where the DeepSpeed formula met a GPU: fp16 stages 0-1 on 1 and 2 H200s; fp16 stages 2-3 and bf16
stages 0-3 on one (results/large_*-h200)."""


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


def deepspeed(
    params: int,
    stage: int,
    num_workers: int,
    precision: str,
    *,
    offload: str = "none",
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS,
    held: Optional[Held] = None,
) -> Prediction:
    """What DeepSpeed 0.19.8 allocates per rank with torch Adam(W), activations aside. `held`: the
    elements its fullest rank holds (ray_zero/measure/partitions.py, from the parameters' shapes: frozen
    ones, the tensors its partitions cut, ZeRO-3's persistent ones); None: an even split, everything
    trainable.

    Stage 0, fp16 (FP16_Optimizer): fp16 params and grads, a flat fp32 master, Adam's two states; its step
    makes an fp32 copy of every gradient and then a flat fp32 gradient: 8Ψ of temporaries, which is why
    stage 0 peaks near 24 bytes per parameter, not 16. bf16 takes the same optimizer (DDP_BFLOAT16: with
    gradients accumulated in bf16, DeepSpeed's default, there is no fp32 accumulator: bf16 peaks where fp16
    does, docs/h200-results.md). fp32: torch AdamW on the module's own parameters, whose foreach step
    needs one fp32 temporary.
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
        # its step peaks 8 bytes per parameter above the states, as stage 0's (docs/h200-results.md), but
        # of one sub-group at a time: each sub-group's fp32 gradient and Adam's temporaries are freed
        # before the next (stage3.py's _release_sub_group).
        parts = dict(
            parameter_bytes=low * h.params,
            gradient_bytes=low * h.gradients,
            master_param_bytes=4 * h.states,
            optimizer_state_bytes=8 * h.states,
            step_transient_bytes=(8 if precision != "fp32" else 4) * h.stepped_at_once,
        )
    if offload != "none":
        # In CPU memory, not on the device: the master, Adam's states, the step, and the gradient
        # partition, which each reduce copies to an fp32 host buffer. The backward's transients above the
        # saved activations are not counted (where they set the peak: OFFLOAD_CHECKED, docs/h200-results.md).
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
    # DDP allocates its buckets (4Ψ) at any world size, one rank too (docs/h200-results.md, "Engines on
    # the 806 M model").
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
    # At one rank too in fp16/bf16: the unsharded parameters are low-precision copies (at stage 2 all of
    # them: a calibration's intercept is the model's low-precision weights); fp32 at one rank computes on
    # the shard itself.
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
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS,
    largest_block_params: Optional[float] = None,
    held: Optional[Held] = None,
) -> Prediction:
    """The engine's prediction; `held` from ray_zero/measure/partitions.py when the parameters' shapes are
    known. An engine without a memory model is an error, never another engine's formula."""
    if backend not in MEMORY_MODELS:
        raise ValueError(f"no memory model for backend {backend!r}; allowed: {', '.join(MEMORY_MODELS)}")
    settings = dict(
        offload=offload, bucket=reduce_bucket_size, block=largest_block_params or params, held=held
    )
    return MEMORY_MODELS[backend](params, stage, num_workers, precision, **settings)


MEMORY_MODELS = registered(
    {
        "deepspeed": lambda p, s, n, precision, offload, bucket, block, held: deepspeed(
            p, s, n, precision, offload=offload, reduce_bucket_size=bucket, held=held
        ),
        "torch_zero": lambda p, s, n, precision, offload, bucket, block, held: torch_zero(
            p, s, n, precision, held
        ),
        "fsdp": lambda p, s, n, precision, offload, bucket, block, held: fsdp(
            p, s, n, precision, block, held
        ),
    },
    "memory models (ray_zero/measure/engine_memory.py)",
)
"""Each registered engine's formula, with the experiment's settings it reads (offload, the reduce bucket,
the largest block)."""
