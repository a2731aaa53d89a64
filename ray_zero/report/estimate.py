"""`estimate`: the memory model's table for a model, without training or Ray.

It plans for the cluster the user will have, not this machine: any size, stage and worker count is
given (`gpu_gib` marks what would not fit a device of that size); only `sweep` and `fit` check what they
are about to run against the machine they run on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from ray_zero.config import BACKEND_STAGES, ConfigError, Experiment
from ray_zero.measure.calibration import read_calibration
from ray_zero.measure.engine_memory import engine_prediction, paper
from ray_zero.measure.memory_model import CUDA_WORKSPACE_BYTES, activation_estimate
from ray_zero.measure.partitions import held
from ray_zero.measure.prediction import GIB


@dataclass
class Estimate:
    """The table (GiB per rank, a row per stage and worker count) and the line that says what it rests on."""

    head: str
    table: pd.DataFrame
    speed_head: str = ""
    speed: Optional[pd.DataFrame] = None
    """With a measured sweep and a bandwidth: samples/s per worker count (report/speed_estimate.py)."""

    def __str__(self) -> str:
        text = self.table.to_string(index=False, float_format=lambda v: f"{v:.3f}", na_rep="-")
        if self.speed is not None:
            speed = self.speed.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-")
            text += f"\n\n{self.speed_head}\n{speed}"
        return f"{self.head}\n{text}"


def estimate(
    experiment: Experiment,
    model,
    *,
    backend: str = "deepspeed",
    stages: Optional[Sequence[int]] = None,
    workers: Sequence[int] = (1, 2, 4, 8),
    precision: str = "fp16",
    micro_batch_size: int = 64,
    calibration_dir: Optional[Path] = None,
    gpu_gib: Optional[float] = None,
) -> Estimate:
    """Per stage and worker count: the paper's model states and the engine's components (GiB per rank),
    and the peak where activations are known (a preset's shapes, or `calibration_dir`'s calibration.json)."""
    if backend not in BACKEND_STAGES:
        raise ConfigError(f"backend must be one of {', '.join(BACKEND_STAGES)}, not {backend!r}")
    calibration = None
    if calibration_dir is not None:
        calibration = read_calibration(Path(calibration_dir))
        if calibration is None:
            raise ConfigError(
                f"--calibration {calibration_dir}: no calibration.json there (give a sweep's folder)"
            )
    if not workers or min(workers) < 1:
        raise ConfigError(f"--workers: give worker counts of at least 1, not {list(workers)}")
    if micro_batch_size < 1:
        raise ConfigError(f"--micro-batch-size: give at least 1, not {micro_batch_size}")
    stages = list(stages or BACKEND_STAGES[backend])
    bad = [s for s in stages if s not in BACKEND_STAGES[backend]]
    if bad:
        raise ConfigError(f"--stages: {backend} has stages {BACKEND_STAGES[backend]}, not {bad[0]}")
    activations, source = activation_estimate(
        experiment.model, micro_batch_size, precision, False, calibration, backend
    )
    fits = f"fits_{gpu_gib:g}_gib" if gpu_gib is not None else None
    rows = []
    for stage in stages:
        for n in workers:
            # What the fullest rank holds, from the parameters' shapes (partitions.py), as a sweep's rows do.
            shares = held(model.trainable_param_shapes, model.frozen_param_shapes, backend, stage, n)
            real = engine_prediction(
                backend,
                model.params,
                stage,
                n,
                precision,
                reduce_bucket_size=experiment.reduce_bucket_size,
                largest_block_params=model.largest_block_params,
                held=shares,
            )
            peak = dataclasses.replace(
                real, activation_bytes=activations, workspace_bytes=CUDA_WORKSPACE_BYTES
            ).peak_bytes
            row = {
                "stage": stage,
                "workers": n,
                "paper_states_gib": paper(model.params, stage, n, precision).model_state_bytes / GIB,
                "params_gib": real.parameter_bytes / GIB,
                "grads_gib": real.gradient_bytes / GIB,
                "master_gib": real.master_param_bytes / GIB,
                "adam_gib": real.optimizer_state_bytes / GIB,
                "states_gib": real.model_state_bytes / GIB,
                "peak_gib": peak / GIB if peak is not None else float("nan"),
            }
            if fits:
                needed = peak if peak is not None else real.model_state_bytes + real.bucket_bytes
                row[fits] = "yes" if needed <= gpu_gib * GIB else "no"
            rows.append(row)
    activation_text = (
        f"activations {activations / GIB:.3f} GiB ({source})"
        if activations is not None
        else "activations unknown (give --calibration DIR of a sweep of this model)"
    )
    head = (
        f"{model.description}; {backend}, {precision}, micro-batch {micro_batch_size}, {activation_text}.\n"
        f"paper = the ZeRO paper's model states; the other columns: what {backend} allocates per rank "
        "(ray_zero.measure.memory_model), GPU peak with 64 MiB of CUDA workspaces"
    )
    if fits:
        head += (
            f"; {fits}: the peak (model states and buckets where activations are unknown) within "
            f"{gpu_gib:g} GiB per GPU"
        )
    return Estimate(head, pd.DataFrame(rows))
