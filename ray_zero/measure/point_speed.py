"""A grid point's step predicted on a profiled device: its traced step's kernels (measure/step_time.py),
an AdamW step over the parameters its fullest rank steps (measure/partitions.py), the engine's hooks and
the communication its overlap rule leaves exposed (measure/engine_time.py). What `estimate --profile`
prints for a point and what a sweep's row stores with its terms (`speed_fields`, for rows.py). Pure: no
torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ray_zero.measure.bandwidth import Bandwidth
from ray_zero.measure.engine_time import EngineTime, engine_time
from ray_zero.measure.gpu_profile import Profile
from ray_zero.measure.partitions import held
from ray_zero.measure.step_time import OpCost, StepTime, predict_step


@dataclass(frozen=True)
class PointSpeed:
    """A point's predicted step: its terms (StepTime, the engine's added) and samples/s of all workers."""

    step: StepTime
    engine: EngineTime
    samples_per_s: float
    comm_counted: bool
    """Communication is in the step: one worker (nothing sent), or a bandwidth given."""

    def terms_ms(self) -> dict[str, Optional[float]]:
        """A step's terms in ms (per step: the micro-batches' summed). The step is the larger of compute +
        memory (the device) and host + hooks (the host) per micro-batch, then the optimizer's step and the
        exposed communication: the terms do not add up to it."""
        s, g = self.step, self.step.accumulation
        return {
            "compute": g * s.compute_s * 1e3,
            "memory": g * s.memory_s * 1e3,
            "host": g * s.host_s * 1e3,
            "hooks": g * s.hooks_s * 1e3,
            "optimizer": s.optimizer_s * 1e3,
            "comm": s.comm_s * 1e3 if self.comm_counted else None,
        }


def point_speed(
    ops: Iterable[OpCost],
    model,
    point,
    profile: Profile,
    precision: str,
    accumulation: int,
    bucket_elements: float,
    bandwidth: Optional[Bandwidth] = None,
) -> PointSpeed:
    """The step of `point` (a config.Point) on `profile`'s device from one micro-batch's traced `ops`, the
    model's description at the point's seq_len (models.describe.ModelInfo), its communication at
    `bandwidth` (not counted without one above one worker)."""
    shapes = model.trainable_param_shapes, model.frozen_param_shapes
    unreached = getattr(model, "unreached_params", ())
    stepped = held(*shapes, point.backend, point.stage, point.num_workers, unreached).states
    kernels = predict_step(ops, profile, stepped, accumulation)
    step, engine = engine_time(kernels, model, point, precision, bandwidth, profile.hook_s, bucket_elements)
    samples_per_s = step.samples_per_s(point.micro_batch_size, point.num_workers)
    return PointSpeed(step, engine, samples_per_s, bandwidth is not None or point.num_workers < 2)


SPEED_TERMS = ("compute", "memory", "host", "hooks", "optimizer", "comm")
"""The predicted step's terms (PointSpeed.terms_ms), each stored in a row as predicted_*_ms."""


def speed_fields(spec) -> dict[str, Any]:
    """The point's step predicted on the profile the spec carries (runtime.profile), from its traced step
    (`point_speed`, as `estimate --profile` predicts it): step ms, samples/s of all workers, the
    term that bounds it and each term; blank, with why, where there is no profile or no traced step."""
    profile = getattr(spec, "profile", None)
    if profile is None:
        return {"speed_note": "no profile given (runtime.profile)"}
    fields: dict[str, Any] = {"speed_profile": profile.source}
    traced, micro = getattr(spec, "activations", None), spec.point.micro_batch_size
    if traced is None or isinstance(traced, str):
        return fields | {"speed_note": f"step not traced{f': {traced}' if traced else ''}"}
    step = traced.at(micro)
    if step is None or not step.ops:
        return fields | {"speed_note": f"step not traced at micro-batch {micro} (the grid's sizes are)"}
    experiment = spec.experiment
    predicted = point_speed(
        step.ops,
        spec.model,
        spec.point,
        profile,
        spec.precision,
        experiment.gradient_accumulation_steps,
        experiment.reduce_bucket_size,
    )
    terms = predicted.terms_ms() | ({} if profile.hook_s else {"hooks": None})
    fields |= {
        "predicted_step_ms": predicted.step.step_s * 1e3,
        "predicted_samples_per_s": predicted.samples_per_s,
        "predicted_speed_bound": predicted.step.bound,
        **{f"predicted_{term}_ms": terms[term] for term in SPEED_TERMS},
    }
    left_out = [
        *(["the engine's hooks (the profile has no seconds per hook)"] if not profile.hook_s else []),
        *(["communication (no bandwidth given)"] if not predicted.comm_counted else []),
    ]
    return fields | ({"speed_note": "not counted: " + "; ".join(left_out)} if left_out else {})
