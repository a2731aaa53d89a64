"""A grid's traced activations, made once before any run: for each engine form, checkpointing setting and
sequence length of the grid, one traced step (ray_zero/train/step_trace.py) at each of its micro-batches,
and one at twice the largest (the slope beyond them, for fit's searches).

`trace_grid` returns, per (form, checkpointing, seq_len), a `Traced` (exact at a traced micro-batch, a line
through the two nearest traced sizes elsewhere) or, where the model's step cannot be traced, the reason
in one line: those points fall back to calibration. torch only: no Ray, no DeepSpeed.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from ray_zero.models.source import ModelError, ModelSource, one_line
from ray_zero.train.step_trace import (
    Form,
    StepTrace,
    TraceError,
    build_on_meta,
    module_form,
    prepare,
    trace_step,
)


@dataclass(frozen=True)
class Traced:
    """One form's traced steps at several micro-batches (ascending)."""

    steps: tuple[StepTrace, ...]

    def at(self, micro_batch: int) -> Optional[StepTrace]:
        """The step traced at exactly this micro-batch, if it was."""
        return next((s for s in self.steps if s.micro_batch == micro_batch), None)

    def rise(self, micro_batch: int, gradient_bytes: float) -> float:
        """StepTrace.rise at `micro_batch`: traced there, else on the line through the two traced sizes
        nearest to it (activations grow with the micro-batch; the sizes' constant part stays)."""
        exact = self.at(micro_batch)
        if exact is not None:
            return exact.rise(gradient_bytes)
        if len(self.steps) == 1:
            only = self.steps[0]
            return only.rise(gradient_bytes) * micro_batch / only.micro_batch
        ordered = sorted(self.steps, key=lambda s: abs(s.micro_batch - micro_batch))[:2]
        (a, b) = sorted(ordered, key=lambda s: s.micro_batch)
        slope = (b.rise(gradient_bytes) - a.rise(gradient_bytes)) / (b.micro_batch - a.micro_batch)
        return max(a.rise(gradient_bytes) + slope * (micro_batch - a.micro_batch), 0.0)

    def per_sample_bytes(self, gradient_bytes: float = 0.0) -> float:
        """The rise's slope over the two largest traced sizes: bytes one more sample adds."""
        a, b = self.steps[-2:] if len(self.steps) > 1 else (None, self.steps[0])
        if a is None:
            return b.rise(gradient_bytes) / b.micro_batch
        return (b.rise(gradient_bytes) - a.rise(gradient_bytes)) / (b.micro_batch - a.micro_batch)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)


Outcome = Union[Traced, str]
"""A form's traces, or why its step could not be traced."""
Key = tuple[Form, bool, Optional[int]]


def trace_key(backend: str, precision: str, checkpointing: bool, seq_len: Optional[int] = None) -> Key:
    """Points that run the module alike share their traces: the engine's module form, checkpointing and the
    point's seq_len (None: the experiment's; every length is a step of its own)."""
    return module_form(backend, precision), bool(checkpointing), seq_len


def trace_grid(
    source: ModelSource, points: Iterable, precision: str, extra_sizes: Iterable[int] = ()
) -> dict[Key, Outcome]:
    """Trace every (form, checkpointing, seq_len) of `points` (config.Point) at `precision` (resolved:
    fp16, bf16 or fp32), at the points' micro-batches, twice the largest, and `extra_sizes`."""
    sizes: dict[Key, set[int]] = {}
    for point in points:
        seq_len = getattr(point, "seq_len", None)
        key = trace_key(point.backend, precision, point.activation_checkpointing, seq_len)
        sizes.setdefault(key, set()).add(point.micro_batch_size)
    outcomes: dict[Key, Outcome] = {}
    for (form, checkpointing, seq_len), wanted in sizes.items():
        wanted |= {2 * max(wanted), *extra_sizes}
        at = source if seq_len is None else dataclasses.replace(source, seq_len=seq_len)
        outcomes[(form, checkpointing, seq_len)] = _trace_form(at, form, checkpointing, sorted(wanted))
    return outcomes


def _trace_form(source: ModelSource, form: Form, checkpointing: bool, sizes: list[int]) -> Outcome:
    from ray_zero.models.describe import build_model_spec

    try:
        spec = build_on_meta(lambda: build_model_spec(source))
        prepare(spec, form, checkpointing)
        return Traced(tuple(trace_step(spec, size, form, checkpointing) for size in sizes))
    except TraceError as error:
        return str(error)
    except ModelError as error:
        return f"the model could not be built for tracing: {error}"
    except Exception as error:  # a model's own code failing on meta is a reason to calibrate, not a crash
        return f"its training step does not run on the meta device: {one_line(error)}"


def traced_names(outcomes: dict[Key, Outcome]) -> str:
    """What was traced, in words: "deepspeed, deepspeed checkpointed" (", seq_len 128" on an axis)."""
    return ", ".join(
        f"{form.name}{' checkpointed' if ck else ''}{f' seq_len {n}' if n is not None else ''}"
        for (form, ck, n), v in outcomes.items()
        if isinstance(v, Traced)
    )


def describe_outcomes(outcomes: dict[Key, Outcome], started: float) -> str:
    """The console's line: what was traced, how long it took, and what could not be."""
    failed = {k: v for k, v in outcomes.items() if not isinstance(v, Traced)}
    parts = traced_names(outcomes) or "none"
    text = f"activations traced on the meta device ({parts}; {time.time() - started:.1f} s)"
    if failed:
        reason = next(iter(failed.values()))
        text += f"; not traced: {reason} (calibrating instead)"
    return text
