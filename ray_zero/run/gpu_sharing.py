"""Which trials may start side by side on one GPU, and the share of it each reserves. Pure: no Ray.

Trials on one GPU take turns to measure (ray_zero/train/turn.py): a trial builds its model and engine
beside the others, then waits for the GPU's turn before its first warm-up step, and lets go of its
memory before it hands the turn on. So at any moment at most one of them is at its peak, and the others
hold what they hold between set-up and their turn (their resident bytes: model states, buckets, the
model as built). The rule: the residents of the trials on a GPU, plus one CUDA context each, plus the
largest step above a resident any of them can take, fit in the GPU's usable memory. Ray's fractional
GPUs enforce it: a trial's share is its resident need over the usable memory left once that largest step
is set aside, so that shares on one GPU sum to at most 1 exactly when the rule holds.

What a point needs comes from the memory model (ray_zero/measure/memory_model.py), with calibrated
activations where calibration.json has them; before calibration (its own trials, and a grid that
starts beside them) from the meta-device count of autograd's saved bytes (ModelInfo), an upper bound,
doubled for the allocator's temporaries. A point whose peak nears the device's memory, or that the model
cannot predict, runs alone: a share of 1. A trial that runs out of memory while sharing is run again
alone (run/trial.py) before its row says `oom`. A trial that starts after one of its engine measured a
peak above its error band takes its share in the same room from its corrected need
(ray_zero/measure/correction.py): the part of its step beyond the largest one set aside is added to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ray_zero.measure.memory_model import predict_point
from ray_zero.measure.prediction import BYTES, GIB, Prediction

CONTEXT_BYTES = 1.5 * GIB
"""Each process's CUDA context, cuBLAS handles and NCCL's buffers, outside the caching allocator."""
RESERVED_FACTOR = 1.15
"""The caching allocator's reserved memory over the allocated bytes the memory model predicts."""
USABLE_FRACTION = 0.92
"""Of the device's memory, what trials may plan to use together."""
ALONE_ABOVE = 0.8
"""A point whose peak (and context) needs more than this fraction of the usable memory runs alone."""
UNCALIBRATED_FACTOR = 2.0
"""Activations before calibration: autograd's saved bytes counted on meta (an upper bound for attention)
times this, for the kernels' temporaries and the loss's fp32 logits that the allocator also holds."""
SHARE_STEP = 1e-4
"""Ray's resolution for fractional resources."""
HOST_BYTES_PER_TRIAL = 4 * GIB
"""Host memory a trial holds while it waits for its turn: its worker, with torch, DeepSpeed, Transformers
and a CUDA context, and its Tune and Train driver processes."""


def trials_per_gpu(setting, cpus: int, gpus: int, host_bytes: Optional[float]) -> int:
    """runtime.max_trials_per_gpu resolved: a number as given; auto, the CPUs per GPU (a trial sets up on
    about one core: imports, model build), and no more than the host memory per GPU holds."""
    if setting != "auto":
        return int(setting)
    by_cpus = max(1, cpus // max(gpus, 1))
    if not host_bytes:
        return by_cpus
    return max(1, min(by_cpus, int(host_bytes / max(gpus, 1) // HOST_BYTES_PER_TRIAL)))


@dataclass(frozen=True)
class Need:
    """Bytes a trial's fullest rank holds on its GPU: while it waits for its turn, and at its peak."""

    resident: float
    peak: float
    basis: str
    """Where the peak comes from: the memory model's basis, or the uncalibrated upper bound."""


def memory_need(
    row: dict, calibration: Optional[dict], saved_bytes_per_sample: Optional[int]
) -> Optional[Need]:
    """The need of a trial whose row (rows.trial_row) says its point, on a GPU; None: not predicted."""
    prediction = predict_point({**row, "memory_kind": "cuda"}, calibration)
    basis = prediction.basis
    if prediction.activation_bytes is None:
        if not saved_bytes_per_sample:
            return None
        # Counted in the model's build dtype (fp32); DeepSpeed and FSDP2 keep half-precision activations,
        # DDP under autocast keeps fp32 residual streams: counted whole.
        scale = 0.5 if BYTES[row["precision"]] == 2 and row["backend"] != "torch_zero" else 1.0
        activations = UNCALIBRATED_FACTOR * scale * saved_bytes_per_sample * row["micro_batch_size"]
        prediction = Prediction(**{**prediction.__dict__, "activation_bytes": activations})
        basis = "uncalibrated upper bound"
    peak = prediction.peak_bytes
    # Between set-up and its turn: the model states (an upper bound: Adam's states come at the first
    # step), the buckets, the workspaces and data, and the model as first built, before the engine casts it.
    resident = (
        prediction.model_state_bytes
        + prediction.bucket_bytes
        + prediction.workspace_bytes
        + prediction.data_bytes
        + float(row.get("param_bytes") or 0)
    )
    return Need(min(resident, peak), peak, basis)


@dataclass(frozen=True)
class Room:
    """What the shares on a GPU were made in: its usable bytes, the largest step above a resident set aside
    for the one trial at its peak, and the smallest share (1 / max_per_gpu)."""

    usable: float
    step: float
    floor: float

    @property
    def left(self) -> float:
        """The usable bytes left for the residents, the largest step set aside."""
        return self.usable - self.step

    def share(self, need: Need, num_workers: int) -> float:
        """A trial's share: its resident bytes (and context) over what is left, and the part of its own
        step beyond the largest one set aside (a corrected need's); 1.0 (alone) near the GPU's memory."""
        peak = RESERVED_FACTOR * need.peak + CONTEXT_BYTES
        resident = RESERVED_FACTOR * need.resident + CONTEXT_BYTES
        if peak > ALONE_ABOVE * self.usable or self.left <= 0:
            return 1.0
        beyond = max(peak - resident - self.step, 0.0)
        share = max(math.ceil((resident + beyond) / self.left / SHARE_STEP) * SHARE_STEP, self.floor)
        if num_workers > 1:
            # Ray may put two workers of one trial on one GPU when their shares fit together there;
            # over half a GPU each, two never do.
            share = max(share, 0.5 + SHARE_STEP)
        return 1.0 if share >= 1.0 - SHARE_STEP else round(share, 4)


@dataclass(frozen=True)
class Sharing:
    """Each trial's share of a GPU, and what the console says of it."""

    shares: dict[str, float]
    """Trial name -> the share of one GPU each of its workers reserves (1.0: it runs alone)."""
    at_once: int
    """Trials that can hold GPUs at once, at most."""
    room: Optional[Room] = None
    """What the shares were made in (a trial corrected later takes its share in the same room)."""

    def describe(self, gpus: int) -> str:
        alone = sum(share >= 1.0 for share in self.shares.values())
        text = f"up to {self.at_once} at once on {gpus} GPU{'s' if gpus != 1 else ''}, measured one at a time"
        if alone:
            text += f" ({alone} alone: predicted near the GPU's memory, or not predicted)"
        return text


def gpu_shares(
    needs: dict[str, Optional[Need]],
    num_workers: dict[str, int],
    gpu_bytes: float,
    gpus: int,
    max_per_gpu: int,
) -> Sharing:
    """Each trial's share of a GPU of `gpu_bytes` under the rule above (module docstring)."""
    usable = USABLE_FRACTION * gpu_bytes
    peak = {n: RESERVED_FACTOR * need.peak + CONTEXT_BYTES for n, need in needs.items() if need}
    resident = {n: RESERVED_FACTOR * need.resident + CONTEXT_BYTES for n, need in needs.items() if need}
    shared = [n for n in needs if n in peak and peak[n] <= ALONE_ABOVE * usable]
    # At most max_per_gpu on a GPU: no share below 1/max_per_gpu (rounded down: exactly that many fit).
    floor = math.floor(1 / max_per_gpu / SHARE_STEP) * SHARE_STEP
    room = Room(usable, max((peak[n] - resident[n] for n in shared), default=0.0), floor)
    shares = {}
    for name, need in needs.items():
        shares[name] = room.share(need, num_workers[name]) if name in shared else 1.0
    smallest = min(shares.values(), default=1.0)
    at_once = min(len(shares), gpus * max(1, math.floor(1 / smallest + 1e-9)))
    return Sharing(shares, at_once, room)


def corrected_share(
    row: dict,
    room: Room,
    share: float,
    correction,
    calibration: Optional[dict],
    saved_bytes_per_sample: Optional[int],
    num_workers: int,
) -> float:
    """The share of a trial (its row: rows.trial_row) planned with `correction` (its engine's miss,
    ray_zero/measure/correction.py) in the room its GPU's shares were made in; never below `share`."""
    need = memory_need(row, calibration, saved_bytes_per_sample)
    if need is None:
        return share
    peak = correction.peak_bytes(need.peak)
    return max(share, room.share(Need(need.resident, peak, need.basis), num_workers))
