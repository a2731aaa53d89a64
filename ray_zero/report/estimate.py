"""`python -m ray_zero estimate`: the memory model's table for a model, without training or Ray.

It plans for the cluster the user will have, not this machine: any size, stage and worker count is
printed (`--gpu-gib G` marks what would not fit a G GiB device); only `sweep` and `fit` check what they
are about to run against the machine they run on.
"""

from __future__ import annotations

import pandas as pd

from ray_zero.config import BACKEND_STAGES, ConfigError, Experiment
from ray_zero.measure.calibration import read_calibration
from ray_zero.measure.memory_model import (
    CUDA_WORKSPACE_BYTES,
    GIB,
    activation_estimate,
    engine_prediction,
    paper,
)
from ray_zero.measure.partitions import held


def estimate_table(experiment: Experiment, model, args) -> str:
    """Per stage and worker count: the paper's model states and the engine's components (GiB per rank)."""
    calibration = None
    if args.calibration is not None:
        calibration = read_calibration(args.calibration)
        if calibration is None:
            raise ConfigError(
                f"--calibration {args.calibration}: no calibration.json there (give a sweep's folder)"
            )
    if min(args.workers) < 1:
        raise ConfigError(f"--workers: give worker counts of at least 1, not {min(args.workers)}")
    if args.micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size: give at least 1, not {args.micro_batch_size}")
    stages = args.stages or list(BACKEND_STAGES[args.backend])
    activations, source = activation_estimate(
        experiment.model, args.micro_batch_size, args.precision, False, calibration, args.backend
    )
    rows = []
    for stage in stages:
        if stage not in BACKEND_STAGES[args.backend]:
            raise ConfigError(
                f"--stages: {args.backend} has stages {BACKEND_STAGES[args.backend]}, not {stage}"
            )
        for workers in args.workers:
            # What the fullest rank holds, from the parameters' shapes (partitions.py), as a sweep's rows do.
            shares = held(
                model.trainable_param_shapes, model.frozen_param_shapes, args.backend, stage, workers
            )
            real = engine_prediction(
                args.backend,
                model.params,
                stage,
                workers,
                args.precision,
                reduce_bucket_size=experiment.reduce_bucket_size,
                largest_block_params=model.largest_block_params,
                held=shares,
            )
            peak = None
            if activations is not None:
                peak = (
                    real.model_state_bytes
                    + real.bucket_bytes
                    + CUDA_WORKSPACE_BYTES
                    + max(activations + real.compute_bytes, real.step_transient_bytes)
                )
            row = {
                "stage": stage,
                "workers": workers,
                "paper_states_gib": paper(model.params, stage, workers, args.precision).model_state_bytes
                / GIB,
                "params_gib": real.parameter_bytes / GIB,
                "grads_gib": real.gradient_bytes / GIB,
                "master_gib": real.master_param_bytes / GIB,
                "adam_gib": real.optimizer_state_bytes / GIB,
                "states_gib": real.model_state_bytes / GIB,
                "peak_gib": peak / GIB if peak is not None else float("nan"),
            }
            if args.gpu_gib is not None:
                needed = peak if peak is not None else real.model_state_bytes + real.bucket_bytes
                row[f"fits_{args.gpu_gib:g}_gib"] = "yes" if needed <= args.gpu_gib * GIB else "no"
            rows.append(row)
    activation_text = (
        f"activations {activations / GIB:.3f} GiB ({source})"
        if activations is not None
        else "activations unknown (give --calibration DIR of a sweep of this model)"
    )
    fits = ""
    if args.gpu_gib is not None:
        fits = (
            f"; fits_{args.gpu_gib:g}_gib: the peak (model states and buckets where activations are unknown) "
            f"within {args.gpu_gib:g} GiB per GPU"
        )
    head = (
        f"{model.description}; {args.backend}, {args.precision}, micro-batch {args.micro_batch_size}, "
        f"{activation_text}.\npaper = the ZeRO paper's model states; the other columns: what "
        f"{args.backend} allocates per rank (ray_zero.measure.memory_model), GPU peak with 64 MiB of CUDA "
        "workspaces"
        f"{fits}"
    )
    return (
        head + "\n" + pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3f}", na_rep="-")
    )
