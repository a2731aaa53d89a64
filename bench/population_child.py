"""One family of the GPU population in one fresh process (a child of bench/population_gpu.py): sized and
its micro-batch chosen on the CPU (population_cases.py), its step traced on the meta device for each form
(ray_zero.train.grid_trace.trace_grid, as a sweep's session traces), and, once the driver says the GPU has
room, each form trained as a sweep's rank trains it (`ray_zero.train.worker.train`, one rank under
torch.distributed: nccl on GPU, gloo on CPU), its row made by ray_zero.rows and written into a run folder
as a sweep writes one (experiment.yaml, trials.jsonl, results.csv/md, per_rank.csv; no pages).

The child talks to the driver through a pipe: ("phase", where), ("sized", the record so far: model, sizes,
micro-batch and why), ("form", summary) after each form,
("plan", {"need_gib": ...}) before it touches the GPU (then waits for "go"), ("done", record). A failure
is one line in the record; the forms already run stay in it and in trials.jsonl.

Also `ops` jobs: one form's step compared op by op (bench/trace_gpu.run_case) on the GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from common import ROOT, one_line

GIB = 2**30
FORMS = {
    "ds1 bf16": ("deepspeed", 1, "bf16", False),
    "ds3 fp16 ckpt": ("deepspeed", 3, "fp16", True),
    "fsdp3 bf16": ("fsdp", 3, "bf16", False),
    "ddp+zero1 bf16 ckpt": ("torch_zero", 1, "bf16", True),
}
"""Each form: (backend, stage, precision, activation checkpointing). torch_zero last, as in scripts/zoo.py:
on an H200, DDP left up to 4 bytes per parameter allocated after its rank returned."""
STEPS, WARMUP = 4, 2
"""Only memory matters here: the peak comes with the first optimizer steps."""


def main(connection, job: dict) -> None:
    """The child's entry point: its output to its log, its record to the driver, whatever happens."""
    log = Path(job["output"]) / "logs" / f"{job['slug']}{'.ops' if job['kind'] == 'ops' else ''}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    sink = open(log, "a", buffering=1)
    os.dup2(sink.fileno(), 1)
    os.dup2(sink.fileno(), 2)
    threads = str(job.get("threads", 1))
    os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # ray_zero; scripts/zoo.py's _release

    def say(kind: str, value: Any) -> None:
        print(f"--- {kind} {time.strftime('%H:%M:%S')}: {value}", flush=True)
        connection.send((kind, value))

    started = time.monotonic()
    record: dict[str, Any] = {}  # filled as the child goes: what it knew when it failed stays
    try:
        run = run_ops if job["kind"] == "ops" else run_family
        if job.get("entry"):  # another bench's family, same protocol: "module:function" (finetune_gpu.py)
            module, name = job["entry"].split(":")
            run = getattr(importlib.import_module(module), name)
        record = run(job, say, connection, record)
    except BaseException as error:  # the harness's own failure, or the model's before any form ran
        print(traceback.format_exc(), flush=True)
        record.update(status="error", error=one_line(error), where=traceback.format_exc()[-800:])
    record["child_s"] = round(time.monotonic() - started, 1)
    say("done", record)


def _experiment(job: dict, sized: dict, micro: int, on_gpu: bool):
    from ray_zero.experiment_file import validate_experiment

    return validate_experiment(
        {
            "name": job["slug"],
            "question": f"{job['family']}: the traced peak against the measured one (issue 65's population)",
            "model": sized["model"],
            "model_config": sized["model_config"],
            "seq_len": sized["seq_len"],
            "input_shape": sized["input_shape"],
            "num_classes": sized["num_classes"],
            "device": "gpu" if on_gpu else "cpu",
            "precision": "bf16",  # each row carries its own (FORMS)
            "steps": STEPS,
            "warmup_steps": WARMUP,
            "timing_min_s": 0,
            "timing_spread": None,
            "calibrate": False,
            "grid": {  # the forms' values; the rows are FORMS' points only
                "backend": sorted({f[0] for f in FORMS.values()}),
                "stage": sorted({f[1] for f in FORMS.values()}),
                "micro_batch_size": [micro],
                "activation_checkpointing": [False, True],
            },
        },
        source=job["family"],
    )


def _provenance(job: dict, experiment, device) -> dict:
    import platform

    import torch
    from common import versions

    on_gpu = device.type == "cuda"
    return {
        "experiment": experiment.name,
        "question": experiment.question,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": job["command"],
        **versions(("torch", "deepspeed", "transformers", "timm")),
        "ray": "not used (bench/population_gpu.py: one rank in one process per family)",
        "driver_gpus": f"1 x {torch.cuda.get_device_name(device)}" if on_gpu else "none",
        "gpu_memory_gib": torch.cuda.get_device_properties(device).total_memory / GIB if on_gpu else None,
        "cpu": f"{platform.machine()} ({os.cpu_count()} logical CPUs)",
        "cluster": "one process, one rank; other families' processes beside it on the device",
        "device": "gpu" if on_gpu else "cpu",
        "precision": "per row: " + ", ".join(f"{n} {f[2]}" for n, f in FORMS.items()),
        "max_concurrent_trials": job.get("jobs", 1),
    }


def form_specs(experiment, model, micro: int, on_gpu: bool, folder: str) -> dict:
    """Each form's TrialSpec, its step traced before any run as a sweep's session traces it (precision per
    form; fp16 on a CPU is bf16, fp16 being GPU-only). A CPU row predicts no peak (zoo.py): traced, not
    used."""
    from ray_zero.config import Point, TrialSpec
    from ray_zero.train.grid_trace import trace_grid, trace_key

    forms = {name: (b, s, p if on_gpu else "bf16", ck) for name, (b, s, p, ck) in FORMS.items()}
    points = {name: Point(b, s, micro, 1, ck) for name, (b, s, p, ck) in forms.items()}
    traced = {}
    for precision in sorted({f[2] for f in forms.values()}):
        chosen_points = [points[n] for n, f in forms.items() if f[2] == precision]
        traced[precision] = trace_grid(experiment.model_source(), chosen_points, precision)
    specs = {}
    for name, (backend, _, precision, ck) in forms.items():
        outcome = traced[precision].get(trace_key(backend, precision, ck))
        specs[name] = TrialSpec(
            experiment, points[name], precision, on_gpu, model, folder,
            label="", activations=outcome if on_gpu else None,
        )  # fmt: skip
    return specs


def run_family(job: dict, say, connection, record: dict) -> dict:
    import torch
    import yaml
    from population_cases import choose_micro_batch, sized_case, source_of

    from ray_zero.models.describe import describe_model
    from ray_zero.rows import trial_row
    from ray_zero.store import EXPERIMENT_FILE, atomic_write

    on_gpu = job["device"] == "gpu"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    say("phase", "sizing")
    sized = sized_case(job["case"], job["params_limit"], job.get("seq_len"))
    if sized["params"] > job["max_params"]:  # would not train on one GPU in any form: not sent to it
        record.update(model=sized["model"], config=sized["model_config"], params=sized["params"],
                      sizes={"size_why": sized["size_why"]})  # fmt: skip
        return {**record, "status": "too large", "error": f"{sized['size_why']}: over --max-params "
                f"{job['max_params'] / 1e9:.3g} B"}  # fmt: skip
    chosen = choose_micro_batch(source_of(sized), job["target_gib"] * GIB)
    micro = chosen["micro_batch"]
    experiment = _experiment(job, sized, micro, on_gpu)
    model = describe_model(experiment.model_source())
    record.update(
        model=sized["model"], config=sized["model_config"], params=model.params,
        sizes={"seq_len": model.seq_len, "description": model.description,
               "params_default": sized.get("params_default"), "size_why": sized["size_why"], **chosen},
    )  # fmt: skip
    say("sized", record)  # the driver's record of a child it stops says what it was running
    say("phase", "tracing")
    specs = form_specs(experiment, model, micro, on_gpu, job["folder"])
    predicted = {name: trial_row(spec) for name, spec in specs.items()}
    skipped, need = plan_forms(predicted, job["gpu_gib"], on_gpu)
    say("plan", {"need_gib": need, "forms": {n: r.get("predicted_peak_gib") for n, r in predicted.items()}})
    if connection.recv() != "go":
        return {**record, "status": "not run", "error": "the driver did not say go"}
    folder = Path(job["folder"])  # written after "go": the provenance's device name opens a CUDA context
    folder.mkdir(parents=True, exist_ok=True)
    provenance = _provenance(job, experiment, device)
    record.update(gpu=provenance["driver_gpus"], gpu_memory_gib=provenance["gpu_memory_gib"])
    atomic_write(
        folder / EXPERIMENT_FILE,
        yaml.safe_dump(
            {
                "experiment": experiment.model_dump(mode="json"),
                "model": dataclasses.asdict(model),
                "provenance": {**provenance, "sizes": record["sizes"]},
            },
            sort_keys=False,
        ),
    )
    return {**record, **_train_forms(job, specs, skipped, device, provenance, say)}


def plan_forms(
    predicted: dict[str, dict], gpu_gib: float, on_gpu: bool
) -> tuple[dict[str, str], Optional[float]]:
    """From each form's row as predicted (trial_row): the forms not run, with why, and the GPU memory the
    rest need at most (None: not all predicted, the driver runs the family alone). A form predicted over
    the whole GPU is not run (a skipped row, as a sweep's plan skips a point): its out-of-memory row would
    say nothing the prediction did not, and it would hold the GPU alone."""
    skipped = {
        name: f"predicted {row['predicted_peak_gib']:.1f} GiB, over the GPU's {gpu_gib:.1f} GiB"
        for name, row in predicted.items()
        if on_gpu and (row.get("predicted_peak_gib") or 0) > gpu_gib
    }
    peaks = [row.get("predicted_peak_gib") for name, row in predicted.items() if name not in skipped]
    known = on_gpu and all(isinstance(p, (int, float)) for p in peaks)
    return skipped, (max(peaks) if peaks else 0.0) if known else None


def _train_forms(job: dict, specs: dict, skipped: dict, device, provenance: dict, say) -> dict:
    """Each form trained in turn in this process (one rank), its row appended to its spec's folder's
    trials.jsonl (spec.storage_path: one folder here, one per experiment in bench/finetune_gpu.py) as it
    ends; the `skipped` ones (name: why) recorded as skipped rows. `provenance`: the results' provenance,
    or {folder: provenance} for several folders. One process group for all: DeepSpeed keeps the first."""
    import torch
    import torch.distributed as dist
    from zoo import _release  # scripts/zoo.py: free what the last run left, the bytes still allocated

    from ray_zero.report.tables import write_results
    from ray_zero.rows import aggregate_ranks, failed_row_fields, finish_row, skipped_row, trial_row
    from ray_zero.store import append_trial
    from ray_zero.train.worker import train

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    baseline = _release(device)
    rows, forms = [], {}
    for name, spec in specs.items():
        folder = Path(spec.storage_path)
        say("phase", f"training {name}")
        row = trial_row(spec)
        leftover = _release(device) - baseline
        started = time.time()
        if name in skipped:
            row = skipped_row(spec, skipped[name])
            append_trial(folder, row)
            rows.append(row)
            forms[name] = _summary(row, spec, leftover)
            say("form", {"name": name, **forms[name]})
            continue
        try:
            result = train(spec, 0, 1, device)  # the model built on the device, as a sweep's rank builds it
        except Exception as error:  # the row says what happened; the next form goes on
            row.update(failed_row_fields({0: error}))
        else:
            row.update(status="ok", **aggregate_ranks([result]))
            row["per_rank"] = [{"trial": spec.name, **result}]
        row.update(attempts=1, wall_s=time.time() - started)
        row = finish_row(row)
        append_trial(folder, row)
        rows.append(row)
        forms[name] = _summary(row, spec, leftover)
        say("form", {"name": name, **forms[name]})
    dist.destroy_process_group()
    for folder in dict.fromkeys(str(spec.storage_path) for spec in specs.values()):
        mine = [row for row, spec in zip(rows, specs.values()) if str(spec.storage_path) == folder]
        write_results(Path(folder), mine, provenance.get(folder, provenance))
    failed = [n for n, f in forms.items() if f["status"] not in ("ok", "skipped")]
    return {
        "status": "ok" if not failed else "some forms failed",
        "error": "; ".join(f"{n}: {forms[n]['error']}" for n in failed) or None,
        "forms": forms,
    }


def _summary(row: dict, spec, leftover: int) -> dict:
    """A form's line in population.jsonl."""
    backend, stage, precision, checkpointing = (
        spec.point.backend, spec.point.stage, spec.precision, spec.point.activation_checkpointing,
    )  # fmt: skip
    return {
        "backend": backend,
        "stage": stage,
        "precision": precision,
        "checkpointing": checkpointing,
        "micro_batch": spec.point.micro_batch_size,
        "status": row.get("status"),
        "memory_kind": row.get("memory_kind"),
        "measured_peak_gib": row.get("peak_allocated_gib_max"),
        "reserved_peak_gib": row.get("peak_reserved_gib_max"),
        "predicted_peak_gib": row.get("predicted_peak_gib"),
        "measured_over_predicted": row.get("measured_over_predicted"),
        "predicted_activation_gib": row.get("predicted_activation_gib"),
        "activation_source": row.get("activation_source"),
        "attention": row.get("trace_attention"),
        "trace_note": row.get("trace_note"),
        "error": row.get("error"),
        "leftover_gib": leftover / GIB,
        "seconds": round(row.get("wall_s") or 0.0, 1),
    }


def run_ops(job: dict, say, connection, record: dict) -> dict:
    """One form's traced step against the same step's CUDA tensors, operator by operator (its model in the
    form's dtype and its step's activations: at most the form's predicted peak, which the driver packs)."""
    from trace_gpu import run_case

    form = job["form"]
    say("plan", {"need_gib": form.get("predicted_peak_gib")})
    if connection.recv() != "go":
        return {"status": "not run", "error": "the driver did not say go"}
    say("phase", f"op by op: {form['name']}")
    compared = run_case(
        job["family"], job["model"], job["config"], job["seq_len"], form["micro_batch"], form["backend"],
        form["precision"], form["checkpointing"],
    )  # fmt: skip
    return {**record, "status": "ok", "ops": compared}
