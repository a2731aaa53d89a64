"""One model of bench/conformance.py, checked in a worker process (a rank as a sweep starts one: gloo,
world size 1): described on the meta device, trained on each engine (the loss finite, each kind of
model-state bytes the memory model's), calibrated on the first engine that trains. ray_zero and torch are
imported in the worker only.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from typing import Any

from common import one_line
from conformance_population import sized_cases

ENGINES = (("deepspeed", 1), ("fsdp", 3))
"""The engines every model trains on: DeepSpeed ZeRO-1, FSDP2 with parameters sharded."""
ENGINE_TITLES = {"deepspeed": "DeepSpeed ZeRO-1", "fsdp": "FSDP2 (stage 3)"}
PRECISION = "bf16"
STEPS, WARMUP_STEPS, MICRO_BATCH = 3, 1, 2
CALIBRATION_STEPS = 2
"""A calibration trial's length here: its micro-batch measured in the first step (Experiment.probe, one
step of warm-up), not the third (calibration.probe_experiment). On the CPU the fit is of autograd's saved
bytes, the same at every step; bf16 runs 10x slower than fp32 on this AVX2 CPU, and the three sizes hold
64 MiB to 192 MiB of activations each, so the 3 steps saved are most of a model's time."""
CALIBRATE_ONCE = True
"""Each model is calibrated on the first engine that trains it (DeepSpeed at stage 0, else FSDP2 at stage
2), not on both: the fit is of autograd's saved bytes on the CPU, the module's own (the engines differ in
it only by what they cast), and one calibration a model is what made the run fit in its time."""
CALIBRATION_FLOOR_BYTES = 4 * 2**20
"""The smallest calibration size's activations here (calibration_probes): 4, 8 and 12 MiB, above the fit's
1 MiB floor for a measured slope."""
STATES = ("parameter_bytes", "gradient_bytes", "master_param_bytes", "optimizer_state_bytes")


def experiment_of(case: dict[str, Any]):
    """The experiment a user would write for this model: bf16 on the CPU, both engines, 3 steps."""
    from ray_zero.experiment_file import validate_experiment

    return validate_experiment(
        {
            "name": case["id"],
            "model": case["model"],
            "model_config": case["model_config"],
            "seq_len": case["seq_len"],
            "input_shape": case["input_shape"],
            "num_classes": case["num_classes"],
            "device": "cpu",
            "precision": PRECISION,
            "steps": STEPS,
            "warmup_steps": WARMUP_STEPS,
            "calibrate": True,
            "grid": {
                "backend": [backend for backend, _ in ENGINES],
                "stage": sorted({stage for _, stage in ENGINES}),
                "micro_batch_size": [MICRO_BATCH],
                "num_workers": [1],
            },
        },
        source=case["id"],
    )


def run_trial(spec) -> dict[str, Any]:
    """One trial on this rank, its row made as a sweep makes it (ray_zero/rows.py)."""
    import torch

    from ray_zero.rows import aggregate_ranks, failed_row_fields, finish_row, trial_row
    from ray_zero.train.worker import train

    row = trial_row(spec)
    started = time.perf_counter()
    try:
        report = train(spec, 0, 1, torch.device("cpu"))
    except Exception as error:  # recorded; the model's other checks go on
        row.update(failed_row_fields({0: error}))
        row["traceback"] = traceback.format_exc()[-3000:]
    else:
        row.update(status="ok", **aggregate_ranks([report]))
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return finish_row(row)


def states_check(row: dict[str, Any], trainable_tensors: int) -> dict[str, Any]:
    """Each kind of model-state bytes against the memory model's: exact, but for the optimizer states'
    Adam step counters (4 bytes per tensor the rank steps, which the model leaves out): tests/test_zoo.py."""
    from ray_zero.measure.memory_model import predict_point

    predicted = predict_point(row)
    found = {}
    for state in STATES:
        measured, expected = row[f"{state}_per_rank_max"], getattr(predicted, state)
        slack = 4 * trainable_tensors + 4 if state == "optimizer_state_bytes" else 0
        found[state] = {
            "measured": measured,
            "predicted": expected,
            "ok": measured is not None and expected <= measured <= expected + slack,
        }
    return found


def calibration_probes(model) -> list:
    """Each engine's calibration points at its smallest stage, at sizes s, 2s, 3s where s keeps about
    CALIBRATION_FLOOR_BYTES of activations (autograd's saved bytes, the meta count halved for bf16).
    calibration.calibration_sizes asks for 64 MiB at least and twice the gradients: on a GPU the
    allocator's rounding and workspaces need that, on a CPU the fit is of autograd's exact saved bytes,
    and 64-192 MiB of bf16 activations cost minutes a model on this CPU."""
    from ray_zero.config import BACKEND_STAGES, Point

    saved = model.saved_bytes_per_sample
    smallest = max(1, min(math.ceil(CALIBRATION_FLOOR_BYTES / (saved * 0.5)), 64)) if saved else 1
    return [
        Point(backend, BACKEND_STAGES[backend][0], smallest * k, 1)
        for backend, _ in ENGINES
        for k in range(1, 4)
    ]


def check_case(case: dict[str, Any], progress) -> dict[str, Any]:
    """Describe, train on each engine, calibrate each engine: the model's record."""
    from ray_zero.config import Point, TrialSpec
    from ray_zero.measure import calibration
    from ray_zero.models.describe import describe_model

    record: dict[str, Any] = {"id": case["id"], "engines": {}}
    progress("describe", record)
    started = time.perf_counter()
    failure = None
    for sized in sized_cases(case):  # the first that describes; the listed case's error if none does
        try:
            experiment = experiment_of(sized)
            model = describe_model(experiment.model_source())
        except Exception as error:
            failure = (one_line(error), traceback.format_exc()[-3000:])
            continue
        case, failure = sized, None
        break
    record.update(
        model_config=case["model_config"], input_shape=case["input_shape"], shrink=case.get("shrink")
    )
    if failure is not None:
        record.update(status="describe failed", error=failure[0], traceback=failure[1])
        return record
    record.update(
        params=model.params,
        task=model.task,
        description=model.description,
        saved_bytes_per_sample=model.saved_bytes_per_sample,
        describe_s=round(time.perf_counter() - started, 1),
    )

    if model.params > case["max_params"]:  # this machine's memory, shared with others' work
        record.update(
            status="too large",
            error=f"{model.params:,} parameters, over the harness's --max-params {case['max_params']:,}",
        )
        return record

    def spec(point, length=experiment, label=""):
        return TrialSpec(length, point, PRECISION, False, model, "unused", label=label)

    trainable_tensors = len(model.trainable_param_shapes)
    probes = calibration_probes(model)
    calibrated = None
    for backend, stage in ENGINES:
        progress(f"{backend} training", record)
        row = run_trial(spec(Point(backend, stage, MICRO_BATCH, 1)))
        engine = record["engines"][backend] = {
            "stage": stage,
            "status": row["status"],
            "error": row.get("error"),
            "traceback": row.get("traceback"),
            "loss_first": row.get("loss_first"),
            "loss_last": row.get("loss_last"),
            "wall_s": row["wall_s"],
        }
        if row["status"] != "ok":
            continue
        engine["states"] = states_check(row, trainable_tensors)
        if calibrated:  # one calibration a model: the first engine that trains (CALIBRATE_ONCE)
            engine["calibration"] = {"skipped": f"calibrated on {calibrated}"}
            continue
        calibrated = backend
        rows = []
        for point in (p for p in probes if p.backend == backend):
            progress(f"{backend} calibration, micro-batch {point.micro_batch_size}", record)
            rows.append(run_trial(spec(point, experiment.probe(CALIBRATION_STEPS), "calibration")))
        fit = calibration.fit_lines(rows, on_gpu=False)[0]
        engine["calibration"] = {
            "verdict": fit["verdict"],
            "stage": rows[0]["stage"],
            "points": fit["points"],
            "bytes_per_sample": fit["bytes_per_sample"],
            "errors": sorted({r["error"] for r in rows if r.get("error")}),
            "wall_s": round(sum(r["wall_s"] for r in rows), 1),
        }
    record["status"] = "checked"
    return record


def worker_main(port: int, log_path: str, connection) -> None:
    """A rank as a sweep starts one (gloo, world size 1); it checks the models it is sent, one at a time,
    and says where it is in each (the driver's record of a model it times out)."""
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    import torch
    import torch.distributed as dist

    from ray_zero.train.worker import jit_ops_dir

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        TORCH_EXTENSIONS_DIR=jit_ops_dir(),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # as a Ray Train worker with one CPU: two workers share the 2 cores
    dist.init_process_group("gloo", rank=0, world_size=1)
    connection.send(("ready", None))
    while True:
        case = connection.recv()
        if case is None:
            break
        print(f"=== {case['id']} {time.strftime('%H:%M:%S')}", flush=True)

        def progress(where: str, record: dict) -> None:
            print(f"--- {where} {time.strftime('%H:%M:%S')}", flush=True)
            connection.send(("progress", {"where": where, "record": record}))

        try:
            record = check_case(case, progress)
        except Exception as error:  # the harness's own failure: recorded as such
            record = {
                "id": case["id"],
                "status": "harness error",
                "error": one_line(error),
                "traceback": traceback.format_exc()[-3000:],
            }
        connection.send(("done", record))
    dist.destroy_process_group()
