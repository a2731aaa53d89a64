"""bench/finetune_gpu.py's tables (issue 66's "Done when"): per family and form, the measured peak against
the traced prediction, whether each model state is the state model's to the byte, and how many parameters
trained; then the seq_len grid's ratios. Markdown, with the machine, versions, date and command lines.

"To the byte" as tests/test_finetune.py checks it: on the fullest rank, parameters, gradients and master
copies equal the state model's (ray_zero.measure.memory_model.predict_point of the row), and the optimizer
states exceed it by Adam's 4-byte step counters only, at most one per trainable tensor (kept on the host
on a GPU: the model leaves them out).

    python bench/finetune_table.py DIR [DIR ...]        # or: python bench/finetune_gpu.py --table DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from population_table import read_records

GIB = 2**30
OFF = 0.05
STATES = ("parameter", "gradient", "master_param", "optimizer_state")
KINDS = ("lora", "frozen")
GRID_ENGINE = "ds1"
"""finetune_gpu.SEQ_ENGINE: the seq_len grid's engine."""


def engine(row: dict) -> str:
    """ds1, ds3, fsdp3, ddp: finetune_gpu.ENGINES' names."""
    return {"deepspeed": "ds", "fsdp": "fsdp", "torch_zero": "ddp"}[row["backend"]] + (
        "" if row["backend"] == "torch_zero" else str(row["stage"])
    )


def states_check(row: dict, tensors: int) -> tuple[bool, str]:
    """(to the byte, what differs): the row's per-kind bytes on its fullest rank against the state model."""
    from ray_zero.measure.memory_model import predict_point

    predicted = predict_point(row)
    off, counters = [], 0
    for state in STATES:
        measured, expected = row.get(f"{state}_bytes_per_rank_max"), getattr(predicted, f"{state}_bytes")
        if not isinstance(measured, (int, float)):
            return False, f"{state} not measured"
        difference = int(measured - expected)
        if state == "optimizer_state" and 0 < difference <= 4 * tensors and difference % 4 == 0:
            counters = difference // 4  # Adam's step counters
        elif difference:
            off.append(f"{state} {difference:+,} B")
    if off:
        return False, "; ".join(off)
    return True, f"+ {counters} step counter{'s' * (counters != 1)}" if counters else "exact"


def _ratio(row: dict) -> str:
    ratio = row.get("measured_over_predicted")
    return f"{ratio:.3f}" if isinstance(ratio, (int, float)) else "-"


def _gib(value) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "-"


def load(folders: list[Path]) -> tuple[dict[str, dict], list[dict]]:
    """({family: its record in finetune.jsonl}, [{family, kind, row, tensors}]) over the run folders."""
    from ray_zero.store import load_trials, read_experiment_file

    records, rows = {}, []
    for folder in folders:
        for record in read_records(folder / "finetune.jsonl"):
            records[record["family"]] = record
            for kind in KINDS:
                run = folder / record["family"] / kind
                if not (run / "trials.jsonl").exists():
                    continue
                model = read_experiment_file(run).get("model") or {}
                tensors = len(model.get("trainable_param_shapes") or ())
                for row in load_trials(run):
                    rows.append({"family": record["family"], "kind": kind, "row": row, "tensors": tensors})
    return records, rows


def _header(records: dict[str, dict]) -> list[str]:
    seen: dict[str, set[str]] = {}
    for record in records.values():
        for key, value in {**(record.get("provenance") or {}), "gpu": record.get("gpu")}.items():
            seen.setdefault(key, set()).add(str(value))
    order = [
        "machine",
        "gpu",
        "python",
        "torch",
        "deepspeed",
        "transformers",
        "timm",
        "peft",
        "date",
        "command",
    ]
    return [f"- {key}: {'; '.join(sorted(seen[key]))}" for key in order if key in seen]


def tables(folders: list[Path]) -> str:
    records, rows = load(folders)

    def at(r: dict, key: str):  # the family's chosen micro-batch and seq_len
        return (records[r["family"]].get("sizes") or {}).get(key)

    def is_form(r: dict) -> bool:  # an engine's row: the chosen micro-batch, the family's seq_len
        row = r["row"]
        return row["micro_batch_size"] == at(r, "micro_batch") and row.get("seq_len") in (
            None,
            at(r, "seq_len"),
        )

    forms = [r for r in rows if is_form(r)]
    grid = [
        r for r in rows
        if r["kind"] == "lora" and r["row"].get("seq_len")
        and r["row"]["micro_batch_size"] == at(r, "grid_micro_batch") and engine(r["row"]) == GRID_ENGINE
    ]  # fmt: skip
    out = [f"# Fine-tuning on one device (issue 66): {len(records)} families, {len(rows)} rows", ""]
    out += _header(records) + [""]
    on_gpu = any(r["row"].get("memory_kind") == "cuda" for r in rows)
    if not on_gpu:
        out += ["CPU rows: the peak is the process's resident set, no peak is predicted; the states still "
                "compare with the state model.", ""]  # fmt: skip
    out += [
        "| family | finetune | engine | micro-batch | seq_len | trained / all params | measured GiB | "
        "predicted GiB | measured/predicted | states to the byte |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    within = exact = ran = 0
    for r in forms:
        row = r["row"]
        seq_len = row.get("seq_len") or at(r, "seq_len") or "-"
        if row.get("status") != "ok":
            out.append(f"| {r['family']} | {r['kind']} | {engine(row)} | {row['micro_batch_size']} | "
                       f"{seq_len} | | | {_gib(row.get('predicted_peak_gib'))} | "
                       f"{row.get('status')}: {(row.get('error') or '')[:120]} | |")  # fmt: skip
            continue
        ran += 1
        ok, why = states_check(row, r["tensors"])
        exact += ok
        ratio = row.get("measured_over_predicted")
        within += isinstance(ratio, (int, float)) and abs(ratio - 1) <= OFF
        out.append(
            f"| {r['family']} | {r['kind']} | {engine(row)} | {row['micro_batch_size']} | "
            f"{seq_len} | {row.get('trainable_params'):,} / {row.get('params'):,} | "
            f"{_gib(row.get('peak_allocated_gib_max'))} | {_gib(row.get('predicted_peak_gib'))} | "
            f"{_ratio(row)} | {'yes' if ok else 'no'} ({why}) |"
        )
    out += ["", f"{ran} of {len(forms)} rows ran; states to the byte in {exact}"
            + (f"; peak within 5 % of the prediction in {within}" if on_gpu else "") + ".", ""]  # fmt: skip
    if grid:
        out += ["## The seq_len grid (LoRA)", ""]
        out += ["| family | engine | micro-batch | seq_len | measured GiB | predicted GiB | "
                "measured/predicted | states |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(grid, key=lambda r: (r["family"], r["row"]["seq_len"])):
            row = r["row"]
            ok, why = states_check(row, r["tensors"]) if row.get("status") == "ok" else (False, row["status"])
            measured, predicted = _gib(row.get("peak_allocated_gib_max")), _gib(row.get("predicted_peak_gib"))
            out.append(
                f"| {r['family']} | {engine(row)} | {row['micro_batch_size']} | {row['seq_len']:,} | "
                f"{measured} | {predicted} | {_ratio(row)} | {'yes' if ok else 'no'} ({why}) |"
            )
        out.append("")
    failed = [(name, r) for name, r in sorted(records.items()) if r.get("status") not in ("ok", "planned")]
    if failed:
        out += ["Families not all ok:", ""]
        out += [f"- {name}: {r.get('status')}: {(r.get('error') or '')[:300]}" for name, r in failed]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(tables([Path(p) for p in sys.argv[1:]]))
