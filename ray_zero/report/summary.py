"""The report page's header and headline: what ran where, the device's memory, and the fastest
setting that fitted for each worker count."""

from __future__ import annotations

import re
from typing import Any, Optional

from ray_zero.report.data import Sweep
from ray_zero.report.formatting import (
    as_number,
    fmt,
    gib_text,
    int_text,
    percent_text,
    present,
    setting_label,
)
from ray_zero.report.frame import NOT_OK


def device_memory(sweep: Sweep) -> tuple[Optional[float], str]:
    """The device's memory in GiB and where that figure comes from, where the folder says it."""
    if sweep.per_rank is not None and "device_memory_gib" in sweep.per_rank:
        values = [v for v in map(as_number, sweep.per_rank["device_memory_gib"]) if v]
        if values:
            return max(values), "the ranks' device memory"
    value = as_number(sweep.provenance.get("gpu_memory_gib"))
    if value:
        return value, "the sweep's provenance"
    for error in sweep.frame["error"].dropna():  # torch's out-of-memory message names the capacity
        found = re.search(r"total capacity of ([\d.]+) GiB", str(error))
        if found:
            return float(found.group(1)), "an out-of-memory error's message"
    return None, ""


def header(sweep: Sweep) -> dict[str, Any]:
    prov, experiment, frame = sweep.provenance, sweep.experiment, sweep.frame
    name = prov.get("experiment") or experiment.get("name") or sweep.folder.name
    question = (prov.get("question") or experiment.get("question") or "").strip()
    first = frame.iloc[0].to_dict() if len(frame) else {}
    models = list(dict.fromkeys(frame["model"].dropna().astype(str)))
    model = ", ".join(models) or str(experiment.get("model") or "?")
    params = as_number(first.get("params"))
    model_text = model + (f" ({int(params):,} parameters)" if params and len(models) == 1 else "")
    hardware = [
        str(prov[k])
        for k in ("hardware", "driver_gpus", "cluster", "cpu")
        if prov.get(k) and not (k == "driver_gpus" and prov[k] == "none")
    ]
    memory, source = device_memory(sweep)
    if memory:
        hardware.append(f"{memory:.1f} GiB per device (from {source})")
    devices = (
        list(dict.fromkeys(sweep.per_rank["device_name"].dropna().astype(str)))
        if sweep.per_rank is not None and "device_name" in sweep.per_rank
        else []
    )
    if devices and not any(d in " ".join(hardware) for d in devices):
        hardware.append("ranks on " + ", ".join(devices))
    versions = prov.get("versions") if isinstance(prov.get("versions"), dict) else {}
    versions = {**{k: prov[k] for k in ("python", "torch", "deepspeed", "ray") if prov.get(k)}, **versions}
    shown = {
        "experiment",
        "question",
        "date",
        "command",
        "versions",
        "hardware",
        "driver_gpus",
        "cluster",
        "cpu",
        "gpu_memory_gib",
        "python",
        "torch",
        "deepspeed",
        "ray",
    }
    others = {k: v for k, v in prov.items() if k not in shown and present(v) and v != ""}
    precisions = list(dict.fromkeys(frame["precision"].dropna().astype(str)))
    datasets = list(dict.fromkeys(frame["dataset"].dropna().astype(str)))
    return {
        "name": name,
        "question": question,
        "model": model_text,
        "training": ", ".join(
            filter(
                None,
                [
                    ", ".join(precisions),
                    ", ".join(datasets),
                    f"{int_text(first.get('steps'))} steps" if first.get("steps") else "",
                ],
            )
        ),
        "hardware": "; ".join(hardware) or "not recorded",
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()) or "not recorded",
        "date": prov.get("date") or "not recorded",
        "command": prov.get("command") or "",
        "others": others,
        "folder": sweep.folder.name,
        "is_fit": sweep.fit is not None,
    }


def headline(sweep: Sweep) -> dict[str, Any]:
    """For each worker count, the fastest configuration that fitted (status ok); the count by status."""
    frame = sweep.frame
    counts = frame["status"].value_counts().to_dict()
    order = ["ok", *NOT_OK] + sorted(set(counts) - {"ok", *NOT_OK})
    summary = f"{len(frame)} trials: " + ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
    ok = frame[(frame["status"] == "ok") & frame["samples_per_s"].notna()]
    fit_note = ""
    if sweep.fit is not None:  # a fit's probes run 3 steps: its timed reruns (…_timed) say the speed
        timed = ok[ok["trial"].str.endswith("_timed")]
        if len(timed):
            ok, fit_note = timed, "timed runs of each setting's largest fitting micro-batch"
    cpu = set(frame["memory_kind"].dropna()) == {"cpu_rss"}
    best = []
    for workers, group in ok.groupby("num_workers", sort=True):
        winner = group.sort_values("samples_per_s", ascending=False).iloc[0].to_dict()
        runner = (
            group.sort_values("samples_per_s", ascending=False).iloc[1].to_dict() if len(group) > 1 else None
        )
        memory = (
            f"peak resident set {gib_text(winner['peak_allocated_gib_max'])} per worker, model states "
            f"{gib_text(winner['measured_model_state_gib'])}"
            if cpu
            else f"peak {gib_text(winner['peak_allocated_gib_max'])} per rank"
            + (
                f" (predicted {gib_text(winner['predicted_peak_gib'])})"
                if present(winner["predicted_peak_gib"])
                else ""
            )
        )
        speed = f"{fmt(winner['samples_per_s'])} samples/s"
        if present(winner.get("mfu")):
            speed += f", MFU {percent_text(float(winner['mfu']))}"
        lightest = group.sort_values("peak_allocated_gib_max").iloc[0].to_dict()
        best.append(
            {
                "workers": int_text(workers),
                "setting": setting_label(winner),
                "micro_batch": int_text(winner["micro_batch_size"]),
                "trial": winner["trial"],
                "speed": speed,
                "memory": memory,
                "of": len(group),
                "runner_up": (
                    f"next: {setting_label(runner)}, micro-batch {int_text(runner['micro_batch_size'])}, "
                    f"{fmt(runner['samples_per_s'])} samples/s, {gib_text(runner['peak_allocated_gib_max'])}"
                )
                if runner
                else "",
                "lightest": (
                    f"least memory: {setting_label(lightest)}, micro-batch "
                    f"{int_text(lightest['micro_batch_size'])}, "
                    f"{gib_text(lightest['peak_allocated_gib_max'])}, "
                    f"{fmt(lightest['samples_per_s'])} samples/s"
                )
                if lightest["trial"] != winner["trial"]
                else "",
            }
        )
    reasons = {}
    for record in frame[frame["status"].isin(NOT_OK)].to_dict("records"):
        reason = str(record.get("error") or "no reason recorded")
        reasons.setdefault((record["status"], reason), []).append(record["trial"])
    not_ok = [{"status": s, "reason": r, "trials": t} for (s, r), t in reasons.items()]
    return {"summary": summary, "best": best, "not_ok": not_ok, "fit_note": fit_note}
