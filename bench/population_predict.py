"""The GPU population's rows predicted again by this checkout, on this machine, without a GPU: as a user
runs `estimate` on a laptop before renting one. Each measured family of OUTPUT/population.jsonl is
described and its four forms traced here (bench/population_child.form_specs, the same code the GPU run
predicted with), and each form's prediction written beside what the GPU measured, a line per family in
OUTPUT/predicted.jsonl (a rerun skips the families there; --again starts it anew). `--table` then reads
these predictions in place of the ones the GPU run made.

    python bench/population_predict.py DIR [--set tuning|held-out|all] [--again]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import ROOT, machine, one_line, versions
from population_table import read_records

PREDICTED = "predicted.jsonl"


def predict_family(record: dict) -> dict:
    from population_child import _experiment, form_specs

    from ray_zero.models.describe import describe_model
    from ray_zero.rows import trial_row

    sizes = record.get("sizes") or {}
    micro = sizes["micro_batch"]
    sized = {
        "model": record["model"],
        "model_config": record.get("config") or {},
        "seq_len": sizes.get("seq_len"),
        "input_shape": None,
        "num_classes": (record.get("case") or {}).get("num_classes"),
    }
    job = {"slug": record["family"].replace(":", "_"), "family": record["family"]}
    experiment = _experiment(job, sized, micro, True)
    model = describe_model(experiment.model_source())
    forms = {}
    for name, spec in form_specs(experiment, model, micro, True, "/nonexistent").items():
        row = trial_row(spec)
        measured = (record["forms"].get(name) or {}).get("measured_peak_gib")
        ok = (record["forms"].get(name) or {}).get("status") == "ok"
        predicted = row.get("predicted_peak_gib")
        forms[name] = {
            "predicted_peak_gib": predicted,
            "measured_over_predicted": measured / predicted if ok and measured and predicted else None,
            "activation_source": row.get("activation_source"),
            "attention": row.get("trace_attention"),
            "predicted_data_gib": row.get("predicted_data_gib"),
            "predicted_activation_gib": row.get("predicted_activation_gib"),
        }
    return {"family": record["family"], "forms": forms}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--set", default="all", choices=["tuning", "held-out", "all"])
    parser.add_argument("--again", action="store_true", help="predict every family again")
    args = parser.parse_args(argv)
    sink = args.output / PREDICTED
    if args.again:
        sink.unlink(missing_ok=True)
    # --again: every family anew (lines kept gzipped stay; the newest line of a family is the one read)
    done = set() if args.again else {record["family"] for record in read_records(sink)}
    latest = {r["family"]: r for r in read_records(args.output / "population.jsonl")}  # a rerun's line wins
    records = list(latest.values())
    command = " ".join(["python", "bench/population_predict.py", *(sys.argv[1:] if argv is None else argv)])
    provenance = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
                  "machine": machine(), **versions(("torch", "transformers", "timm"))}  # fmt: skip
    for record in records:
        measured = any(f.get("status") == "ok" for f in (record.get("forms") or {}).values())
        if record["family"] in done or not measured or args.set not in ("all", record["set"]):
            continue
        started = time.perf_counter()
        try:
            line = predict_family(record)
        except Exception as error:  # the family's own failure here, one line
            line = {"family": record["family"], "error": one_line(error)}
        line.update(seconds=round(time.perf_counter() - started, 1), provenance=provenance)
        with sink.open("a") as file:
            file.write(json.dumps(line) + "\n")
        ratios = {n: f.get("measured_over_predicted") for n, f in (line.get("forms") or {}).items()}
        shown = ", ".join(f"{n} {r:.3f}" if isinstance(r, float) else f"{n} -" for n, r in ratios.items())
        print(f"{record['family']} [{record['set']}]: {shown or line.get('error')} ({line['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    sys.exit(main())
