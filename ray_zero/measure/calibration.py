"""Activation memory measured: a short calibration before the grid, for the engines whose training step
could not be traced on the meta device (ray_zero/train/grid_trace.py), or for all of them as a check
(`calibrate: true`).

The memory model knows what each engine keeps for the model states; what one micro-batch keeps for
backward depends on the model's code, and on the engine: DeepSpeed and FSDP2 run the module in fp16/bf16,
PyTorch's DDP (torch_zero) runs an fp32 module under autocast, which keeps fp32 residual streams and cast
copies. So each engine of the grid is calibrated on its own: one worker, its smallest stage, three or
more micro-batches, each a few steps long. Each rank measures, on one micro-batch of the third step
(steady state: the first step also allocates gradients, optimizer states, buckets and workspaces), how
far its forward and backward raise allocated memory above what was allocated before it (GPU,
`micro_batch_rise_bytes`) and the bytes autograd saved for backward (any device). A straight line
through the points gives bytes per sample (its slope; the intercept is what any micro-batch adds, e.g.
gradients, which the memory model counts with the model states). Where the two largest sizes rise more
steeply than that line, their slope is taken: a rise is the largest of the step's moments, and at a small
micro-batch a moment whose size does not grow with it (a workspace, a transient buffer) can set it. On an
H200, BERT-large's point at 2 sat 0.26 GiB above the line of 4, 6, 8 and 16 and tilted a least-squares
slope 11 % low; a larger micro-batch extrapolates from the larger sizes' slope.

The sizes are chosen so that activations dominate: the smallest keeps about twice the model's
low-precision gradients in activations (the meta-device count of autograd's saved bytes, ModelInfo).
A calibration whose points are not on a line, whose slope is zero, or whose allocator slope disagrees
with autograd's by more than `AUTOGRAD_FACTOR` is kept but marked doubtful: the rows it predicts say so
in `prediction`, and the console says so in one line. `calibration.json` keeps the points and the fits.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional

from ray_zero.config import BACKEND_STAGES, Experiment, Point
from ray_zero.store import atomic_write

CALIBRATION_FILE = "calibration.json"
SIZES = 3
"""Micro-batches per line: three, so that a bend shows."""
CALIBRATION_STEPS, CALIBRATION_WARMUP = 5, 3
"""The measured micro-batch is the first of step warmup - 1 = 2: after two optimizer steps. Not step 1:
DDP rebuilds its gradient buckets at the start of its second iteration, and on an H200 that rebuild (4
bytes per parameter) landed inside the measured micro-batch at some sizes and not others."""
NONLINEAR = 0.05
"""A line whose largest residual exceeds this fraction of the largest size's activations is 'not linear'."""
AUTOGRAD_FACTOR = 2.5
"""GPU: the allocator's bytes per sample may exceed autograd's saved bytes (kernels' temporaries, the
loss's fp32 logits), but more than this factor apart, either way, the two disagree."""
ACTIVATION_FLOOR_BYTES = 64 * 2**20
"""The smallest size keeps at least this much in activations: well above the allocator's rounding."""
GPU_ACTIVATION_FLOOR_BYTES = 2**30
"""On a GPU, at least this much: cuDNN picks a convolution's algorithm and workspace per shape, and those
transients (tens to hundreds of MiB) bent ResNet-50's line at 3, 6 and 9 samples (117-350 MiB of
activations) on an H200."""


def engines_to_calibrate(
    experiment: Experiment, use_gpu: bool, untraced: set[tuple[str, bool]]
) -> set[tuple[str, bool]]:
    """The (engine, checkpointing) pairs of the grid to calibrate: `calibrate: true`, all of them (a
    check beside the traced prediction); `auto`, on GPU, those whose step could not be traced (`untraced`)
    for a model that is not a preset (the presets' activations are counted from their shapes); false,
    none."""
    every = {
        (backend, checkpointing)
        for backend in experiment.grid.backend
        for checkpointing in experiment.grid.activation_checkpointing
    }
    if experiment.calibrate is True:
        return every
    if experiment.calibrate == "auto" and use_gpu and not experiment.is_preset():
        return every & untraced
    return set()


def probe_experiment(experiment: Experiment) -> Experiment:
    """A calibration trial's length: long enough for a steady-state micro-batch, no longer."""
    return experiment.model_copy(
        update={"steps": CALIBRATION_STEPS, "warmup_steps": CALIBRATION_WARMUP, "epochs": None}
    )


def calibration_sizes(model=None, precision: str = "fp16", on_gpu: bool = False) -> list[int]:
    """Three micro-batches s, 2s, 3s whose activations dominate: at s, about twice the low-precision
    gradients (and at least ACTIVATION_FLOOR_BYTES, GPU_ACTIVATION_FLOOR_BYTES on a GPU), by the
    meta-device count of autograd's saved bytes per sample (built in fp32: halved for fp16/bf16).
    1, 2, 3 when that count is unknown."""
    saved = getattr(model, "saved_bytes_per_sample", None)
    params = getattr(model, "trainable_params", None) or getattr(model, "params", None) or 0
    if not saved:
        return [1, 2, 3]
    scale = 0.5 if precision in ("fp16", "bf16") else 1.0
    target = max(2 * 2 * params, GPU_ACTIVATION_FLOOR_BYTES if on_gpu else ACTIVATION_FLOOR_BYTES)
    smallest = max(1, min(math.ceil(target / (saved * scale)), 256))
    return [smallest * k for k in range(1, SIZES + 1)]


def calibration_points(
    experiment: Experiment,
    model=None,
    precision: str = "fp16",
    on_gpu: bool = False,
    engines: Optional[set[tuple[str, bool]]] = None,
) -> list[Point]:
    """Per engine of the grid (at its smallest stage) and per checkpointing setting (those of `engines`,
    if given): one worker at each of `calibration_sizes`; on a seq_len axis, at its longest value (the
    figure serves that value's rows only: `lookup`)."""
    sizes = calibration_sizes(model, precision, on_gpu)
    seq_len = experiment.seq_lens()[-1] if experiment.grid.seq_len else None
    return [
        Point(backend, BACKEND_STAGES[backend][0], size, 1, checkpointing, seq_len=seq_len)
        for backend in dict.fromkeys(experiment.grid.backend)
        for checkpointing in sorted(set(experiment.grid.activation_checkpointing))
        if engines is None or (backend, checkpointing) in engines
        for size in sizes
    ]


def _line(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares through (micro-batch, bytes): slope, intercept, largest |residual|. Points of one
    size (a search that measured it twice) are averaged first."""
    by_size: dict[float, list[float]] = {}
    for x, y in points:
        by_size.setdefault(x, []).append(y)
    points = [(x, statistics.fmean(ys)) for x, ys in sorted(by_size.items())]
    if len(points) == 1:
        return 0.0, points[0][1], 0.0
    if len(points) == 2:
        (x0, y0), (x1, y1) = points
        slope = (y1 - y0) / (x1 - x0)
        return slope, y0 - slope * x0, 0.0
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return slope, intercept, max(abs(y - (slope * x + intercept)) for x, y in points)


def fit_lines(rows: list[dict[str, Any]], on_gpu: bool) -> list[dict[str, Any]]:
    """One fit per (engine, checkpointing) among the calibration rows: its points, slope (bytes per
    sample), intercept, residual, autograd's slope beside it, and a verdict ("ok" or why doubtful)."""
    key = "micro_batch_rise_bytes_per_rank_max" if on_gpu else "saved_for_backward_bytes_per_rank_max"
    fits = []
    groups = dict.fromkeys(
        (r.get("backend", "deepspeed"), bool(r.get("activation_checkpointing"))) for r in rows
    )
    for backend, checkpointing in groups:
        mine = [
            r
            for r in rows
            if r.get("backend", "deepspeed") == backend
            and bool(r.get("activation_checkpointing")) == checkpointing
        ]
        ok = sorted(
            (r for r in mine if r.get("status") == "ok" and r.get(key) is not None),
            key=lambda r: r["micro_batch_size"],
        )
        points = [[r["micro_batch_size"], float(r[key])] for r in ok]
        fit: dict[str, Any] = {
            "backend": backend,
            "checkpointing": checkpointing,
            "measured": key,
            "points": points,
            "bytes_per_sample": None,
            "verdict": "not measured",
        }
        fits.append(fit)
        if len({x for x, _ in points}) < 2:
            fit["verdict"] = f"not measured ({len(points)} of {len(mine)} calibration trials gave a figure)"
            continue
        least_squares, intercept, residual = _line(points)
        slope = max(least_squares, _line(points[-2:])[0])
        fit.update(
            bytes_per_sample=max(slope, 0.0),
            least_squares_bytes_per_sample=least_squares,
            intercept_bytes=intercept,
            max_residual_bytes=residual,
        )
        autograd = [
            (r["micro_batch_size"], float(r["saved_for_backward_bytes_per_rank_max"]))
            for r in ok
            if r.get("saved_for_backward_bytes_per_rank_max") is not None
        ]
        autograd_slope = _line(autograd)[0] if len({x for x, _ in autograd}) >= 2 else None
        fit["autograd_bytes_per_sample"] = autograd_slope
        largest = points[-1][0]
        if slope * largest < 2**20:  # under 1 MiB at the largest size: nothing measured
            fit["verdict"] = "doubtful: zero (activations under 1 MiB at the largest size)"
        elif residual > NONLINEAR * least_squares * largest:
            fit["verdict"] = (
                f"doubtful: not linear (a point {residual / (least_squares * largest):.0%} of the largest "
                "size's activations off the line)"
            )
        elif (
            on_gpu and autograd_slope and not 1 / AUTOGRAD_FACTOR <= slope / autograd_slope <= AUTOGRAD_FACTOR
        ):
            fit["verdict"] = (
                f"doubtful: {slope / autograd_slope:.2f}x autograd's saved bytes per sample "
                f"(allowed {1 / AUTOGRAD_FACTOR:.1f}-{AUTOGRAD_FACTOR:.1f}x)"
            )
        else:
            fit["verdict"] = "ok"
    return fits


def _by_backend(fits: list[dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    table: dict[str, dict[str, Optional[float]]] = {}
    for fit in fits:
        table.setdefault(fit["backend"], {})["checkpointed" if fit["checkpointing"] else "plain"] = fit[
            "bytes_per_sample"
        ]
    return table


def per_sample_bytes(rows: list[dict[str, Any]], on_gpu: bool) -> dict[str, Optional[float]]:
    """Bytes per sample, plain and checkpointed, of the first engine among the rows (a search's own)."""
    fits = fit_lines(rows, on_gpu)
    return next(iter(_by_backend(fits).values()), {})


def lookup(
    calibration: Optional[dict], backend: str, checkpointing: bool, seq_len: Optional[int] = None
) -> tuple[Optional[float], str]:
    """Bytes per sample for a row of `backend`, and what it rests on: that engine's own fit, else the
    first engine's (a file of an older version, or an engine not calibrated). A row on a seq_len axis
    (`seq_len`) only at the length calibrated: bytes per sample at one length say nothing of another."""
    if not calibration:
        return None, "no calibration"
    if seq_len is not None and calibration.get("seq_len") != seq_len:
        return None, f"calibrated at seq_len {calibration.get('seq_len')}, not {seq_len}"
    key = "checkpointed" if checkpointing else "plain"
    own = (calibration.get("by_backend") or {}).get(backend, {})
    if own.get(key) is not None:
        fit = next(
            (
                f
                for f in calibration.get("fits", [])
                if f["backend"] == backend and f["checkpointing"] == checkpointing
            ),
            {},
        )
        verdict = fit.get("verdict", "ok")
        return own[key], "activations calibrated" + ("" if verdict == "ok" else f" ({verdict})")
    value = (calibration.get("bytes_per_sample") or {}).get(key)
    if value is None:
        return None, "no calibration"
    source = calibration.get("calibrated_on")
    return value, "activations calibrated" + (f" on {source}" if source and source != backend else "")


def read_calibration(output_dir: Path) -> Optional[dict]:
    """A results folder's calibration.json, None where it has none."""
    path = output_dir / CALIBRATION_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_calibration(
    output_dir: Path, experiment: Experiment, rows: list[dict[str, Any]], on_gpu: bool, precision: str
) -> dict:
    fits = fit_lines(rows, on_gpu)
    by_backend = _by_backend(fits)
    first = next(iter(by_backend), None)
    calibration = {
        "model": experiment.model,
        "model_config": experiment.model_options,
        "seq_len": next((r["seq_len"] for r in rows if r.get("seq_len") is not None), experiment.seq_len),
        "precision": precision,
        "device": "cuda" if on_gpu else "cpu",
        "measured": "micro_batch_rise_bytes (GPU allocator)"
        if on_gpu
        else "saved_for_backward_bytes (autograd)",
        "calibrated_on": first,
        "bytes_per_sample": by_backend.get(first, {}),
        "by_backend": by_backend,
        "fits": fits,
        "trials": [
            {
                k: r.get(k)
                for k in (
                    "trial",
                    "backend",
                    "status",
                    "micro_batch_size",
                    "activation_checkpointing",
                    "micro_batch_rise_bytes_per_rank_max",
                    "saved_for_backward_bytes_per_rank_max",
                    "error",
                )
            }
            for r in rows
        ],
    }
    atomic_write(output_dir / CALIBRATION_FILE, json.dumps(calibration, indent=2))
    return calibration


def summary(calibration: dict) -> str:
    """The console's line: bytes per sample per engine, and any doubtful fit named."""
    parts, doubtful = [], []
    for fit in calibration.get("fits", []):
        name = fit["backend"] + (" checkpointed" if fit["checkpointing"] else "")
        value = fit["bytes_per_sample"]
        parts.append(f"{name} {value / 2**20:.1f} MiB" if value is not None else f"{name} not measured")
        if fit["verdict"] != "ok":
            doubtful.append(f"{name}: {fit['verdict']}")
    text = "activations per sample: " + (", ".join(parts) or "not measured (see calibration.json)")
    if doubtful:
        text += "; rows predicted from it are marked (" + "; ".join(doubtful) + ")"
    return text
