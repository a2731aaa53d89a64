"""`estimate`: the prediction of every point of an experiment's grid, without training or Ray.

It plans for the cluster the user will have, not this machine: any size, stage and worker count is
given (`gpu_gib` marks what would not fit a device of that size); only `sweep` and `fit` check what they
are about to run against the machine they run on. Each row is what a sweep's row of that point predicts
(ray_zero/rows.py's trial_row, on a GPU): the model states, what one micro-batch's traced step adds, the
transients and workspaces, term by term.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from ray_zero.config import ConfigError, Experiment, TrialSpec
from ray_zero.measure import error_band
from ray_zero.measure.bandwidth import Bandwidth
from ray_zero.measure.calibration import read_calibration
from ray_zero.measure.engine_memory import paper
from ray_zero.measure.gpu_profile import Profile
from ray_zero.measure.meter import peak_tflops
from ray_zero.measure.point_speed import point_speed as predict_point_speed
from ray_zero.measure.prediction import GIB
from ray_zero.rows import band_fields, trial_row
from ray_zero.train.grid_trace import Traced, trace_grid, trace_key, traced_names

TERMS = (  # (column, the row's predicted_*_gib terms it adds up)
    ("params_gib", ("parameter",)),
    ("grads_gib", ("gradient",)),
    ("master_gib", ("master_param",)),
    ("adam_gib", ("optimizer_state",)),
    ("buckets_gib", ("bucket",)),
    ("activations_gib", ("activation",)),
    ("gathered_gib", ("compute",)),
    ("step_temp_gib", ("step_transient",)),
    ("other_gib", ("workspace", "data")),
)
VARYING = ("activation_checkpointing", "offload_optimizer", "seq_len")
"""Point fields shown only where the grid varies them."""


@dataclass
class Estimate:
    """The table (GiB per rank, a row per grid point) and the lines that say what it rests on."""

    head: str
    table: pd.DataFrame
    speed_head: str = ""
    speed: Optional[pd.DataFrame] = None
    """With a measured sweep and a bandwidth: samples/s per worker count (report/speed_estimate.py)."""
    rows: Optional[list] = None
    """Each point's row, as a sweep's row of it would hold its prediction (rows.trial_row)."""

    def add_speed(self) -> None:
        """samples/s beside each point's memory, where the speed table predicts its engine, stage,
        micro-batch and worker count."""
        if self.speed is None or not len(self.speed):
            return
        keys = ["backend", "stage", "micro_batch", "workers"]
        speed = self.speed[keys + ["samples_per_s"]].drop_duplicates(keys)
        self.table = self.table.merge(speed, on=keys, how="left")

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
    calibration_dir: Optional[Path] = None,
    gpu_gib: Optional[float] = None,
    gpu: Optional[str] = None,
    profile: Optional[Profile] = None,
    bandwidth: Optional[Bandwidth] = None,
) -> Estimate:
    """Every point of `experiment`'s grid that an engine can run, predicted on a GPU: its step traced on
    the meta device (or `calibration_dir`'s calibration.json where it cannot be), with its error band
    (checked against `gpu`, a GPU's name, where given); with `profile`, its step time on that GPU, its
    communication at `bandwidth` where given."""
    calibration = None
    if calibration_dir is not None:
        calibration = read_calibration(Path(calibration_dir))
        if calibration is None:
            raise ConfigError(
                f"--calibration {calibration_dir}: no calibration.json there (give a sweep's folder)"
            )
    points = experiment.grid.points()
    if not points:
        raise ConfigError("the grid has no point an engine can run (see its backend and stage)")
    precision = experiment.resolved_precision(use_gpu=True)
    started = time.time()
    traces = trace_grid(experiment.model_source(), points, precision)
    traced_s = time.time() - started
    rows, speeds = [], []
    for point in points:
        traced = traces[trace_key(point.backend, precision, point.activation_checkpointing, point.seq_len)]
        if profile is not None:
            speeds.append(point_speed(point, traced, model, profile, experiment, precision, bandwidth))
        spec = TrialSpec(
            experiment,
            point,
            precision,
            True,
            model,
            "",
            activations=traced,
            calibration=calibration,
        )
        row = trial_row(spec)
        rows.append(row | band_fields(row, gpu))
    table = pd.DataFrame([_line(row, gpu_gib) for row in rows])
    if speeds:
        table = pd.concat([table, pd.DataFrame(speeds)], axis=1)
    for field in VARYING:
        if field in table and table[field].nunique() <= 1:
            table = table.drop(columns=field)
    head = _head(experiment, model, precision, traces, traced_s, gpu_gib)
    head += _band_head(rows, gpu, gpu_gib) + (_speed_head(profile, bandwidth) if profile is not None else "")
    return Estimate(head, table, rows=rows)


def point_speed(
    point, traced, model, profile: Profile, experiment: Experiment, precision: str, bandwidth
) -> dict:
    """The point's step on the profile's GPU (measure/point_speed.py, as a sweep's row stores it): its
    traced kernels, an AdamW step over the parameters its fullest rank steps, the engine's hooks and
    exposed communication; blank where the step was not traced."""
    step = traced.at(point.micro_batch_size) if isinstance(traced, Traced) else None
    if step is None or not step.ops:
        return dict.fromkeys(SPEED_COLUMNS)
    model = model.at(point.seq_len)
    accumulation, bucket = experiment.gradient_accumulation_steps, experiment.reduce_bucket_size
    predicted = predict_point_speed(
        step.ops, model, point, profile, precision, accumulation, bucket, bandwidth
    )
    samples_per_s = predicted.samples_per_s
    peak = peak_tflops(profile.hardware, precision)
    flops = model.flops_per_sample * samples_per_s / point.num_workers  # per GPU
    terms = predicted.terms_ms()
    return {
        "step_ms": predicted.step.step_s * 1e3,
        "comm_ms": terms["comm"],
        "hooks_ms": terms["hooks"] if profile.hook_s else None,
        "predicted_samples_per_s": samples_per_s,
        "mfu": flops / (peak * 1e12) if peak and model.flops_per_sample else None,
        "bound": predicted.step.bound,
    }


SPEED_COLUMNS = ("step_ms", "comm_ms", "hooks_ms", "predicted_samples_per_s", "mfu", "bound")


def _speed_head(profile: Profile, bandwidth: Optional[Bandwidth]) -> str:
    hooks = (
        f"the engine's hooks at {profile.hook_s * 1e6:.2f} us each (a bare module hook: the floor)"
        if profile.hook_s
        else "the engine's hooks not counted (the profile has no seconds per hook)"
    )
    comm = (
        f"comm_ms: the communication each engine's overlap rule leaves exposed at {bandwidth.source}"
        if bandwidth is not None
        else "comm_ms: communication not counted above one worker (give --bandwidth FILE or --busbw GB/s)"
    )
    return (
        f".\nstep_ms, predicted_samples_per_s (all workers): each traced kernel on {profile.source}, the "
        "larger of its FLOPs over its kind's rate and its bytes over the bandwidth, beside the host's "
        f"launches ({profile.launch_s * 1e6:.1f} us each) and {hooks} (hooks_ms, a step's); {comm} "
        "(measure/engine_time.py); mfu: model FLOPs per GPU over its dense peak (blank: a device the peak "
        "table does not name); bound: the term that sets the step (compute, memory, host, communication). "
        "Not counted yet: the engine's copies, the optimizer's launches, the loss read back"
    )


def _line(row: dict, gpu_gib: Optional[float]) -> dict:
    line = {
        "backend": row["backend"],
        "stage": row["stage"],
        "workers": row["num_workers"],
        "micro_batch": row["micro_batch_size"],
        "seq_len": row.get("seq_len"),
        "activation_checkpointing": row["activation_checkpointing"],
        "offload_optimizer": row["offload_optimizer"],
        "paper_states_gib": paper(
            row["params"], row["stage"], row["num_workers"], row["precision"]
        ).model_state_bytes
        / GIB,
    }
    for column, terms in TERMS:
        values = [row.get(f"predicted_{term}_gib") for term in terms]
        line[column] = sum(v for v in values if v is not None) if any(v is not None for v in values) else None
    peak = row.get("predicted_peak_gib")
    line["peak_gib"] = peak if peak is not None else float("nan")
    line["peak_high_gib"] = row.get("predicted_peak_high_gib", float("nan"))
    if gpu_gib is not None:
        if peak is not None:  # the band's upper end as the row carries it (checked against `gpu`)
            needed = error_band.needed_gib(row["predicted_peak_high_gib"])
        else:  # no activation term: the model states and buckets at least
            needed = row["predicted_model_state_gib"] + (line["buckets_gib"] or 0)
        line[f"fits_{gpu_gib:g}_gib"] = "yes" if needed <= gpu_gib else "no"
    line["activations"] = row.get("activation_source", "")
    return line


def _head(experiment: Experiment, model, precision: str, traces: dict, traced_s: float, gpu_gib) -> str:
    untraced = [t for t in traces.values() if not isinstance(t, Traced)]
    text = (
        f"{model.description}; {precision}, accumulation {experiment.gradient_accumulation_steps}. "
        f"Activations: one training step traced on the meta device as a GPU runs it "
        f"({traced_names(traces) or 'none'}; {traced_s:.1f} s)"
    )
    if untraced:
        text += f"; not traced: {untraced[0]} (give --calibration DIR of a sweep of this model)"
    text += (
        ".\npaper = the ZeRO paper's model states; the other columns: what each engine allocates per rank "
        "(ray_zero.measure.memory_model), GPU peak with 64 MiB of cuBLAS workspaces"
    )
    return text


def _band_head(rows: list[dict], gpu: Optional[str], gpu_gib: Optional[float]) -> str:
    """The error band the rows carry (one model: one class), where it was measured, and what `fits`
    compares with the GPU's memory."""
    bands = list(dict.fromkeys(r["predicted_band"] for r in rows if r.get("predicted_band")))
    about = error_band.measured()["about"]
    text = ""
    if bands:
        gpus = ", ".join(about["gpus"])
        text += (
            f".\nError band of the peak (measured/predicted - 1 of the class's rows on {gpus}"
            f", torch {'-'.join(about['torch_range'])}): {'; '.join(bands)}; peak_high_gib: the peak at its "
            f"upper end" + ("" if gpu else " (no GPU named: --gpu NAME checks its architecture)")
        )
    if gpu_gib is not None:
        text += (
            f".\nfits_{gpu_gib:g}_gib: the peak at its band's upper end, +{error_band.RESERVE_FRACTION:.0%} "
            f"for the allocator's reserve and {error_band.CONTEXT_GIB:g} GiB of CUDA context, within "
            f"{gpu_gib:g} GiB (model states and buckets where the peak is unknown)"
        )
    return text


def grid_overrides(workers, stages, backend, precision, micro_batch_size, seq_len=None) -> list[str]:
    """estimate's keyword arguments as the `--set` items of the keys they narrow."""
    keys = {
        "grid.num_workers": workers,
        "grid.stage": stages,
        "grid.backend": [backend] if isinstance(backend, str) else backend,
        "grid.micro_batch_size": [micro_batch_size]
        if isinstance(micro_batch_size, int)
        else micro_batch_size,
        "grid.seq_len": [seq_len] if isinstance(seq_len, int) else seq_len,
        "precision": precision,
    }
    return [
        f"{key}={json.dumps(list(value) if isinstance(value, (list, tuple)) else value)}"
        for key, value in keys.items()
        if value is not None
    ]


def this_gpu() -> Optional[str]:
    """This machine's GPU's name (None without one)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def this_gpu_gib() -> Optional[float]:
    """This machine's GPU memory, GiB (None without one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 1024**3
