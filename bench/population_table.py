"""bench/population_gpu.py's tables from its records (OUTPUT/population.jsonl and ops.jsonl of one or more
parts), each split into the tuning families and the held-out third: per class and form, the rows,
median |measured / predicted - 1|, how many within 5 %, the range, how many under-predicted by more than
5 %; then every row off by more than 5 % with its op-by-op hint. The machine, versions, dates and commands
once per table, from the records' provenance. No GPU, no torch.
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

from common import ROOT
from population_child import FORMS

sys.path.insert(0, str(ROOT))
from ray_zero.measure import error_band  # noqa: E402
from ray_zero.measure.error_band import CLASSES  # noqa: E402

GIB = 2**30
OFF = 0.05
SETS = ("tuning", "held-out")


def class_of(record: dict) -> str:
    kind = {"transformers": "hf"}.get(record.get("source"), record.get("source"))
    return error_band.class_of(kind, record.get("task"))


def read_records(path: Path) -> list[dict]:
    """A .jsonl file's records after its kept .jsonl.gz's (bench/records.py population): a part run in a
    kept folder appends to the plain file, and both count."""
    kept = path.with_name(path.name + ".gz")
    text = gzip.decompress(kept.read_bytes()).decode() if kept.is_file() else ""
    if path.is_file():
        text += "\n" + path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load(
    folders: list[Path], predicted: bool = False
) -> tuple[dict[str, dict], dict[tuple[str, str], dict]]:
    """Each family's latest record, and each (family, form)'s latest op-by-op record, over the parts.
    `predicted`: each form's prediction as bench/population_predict.py made it again (predicted.jsonl),
    in place of the GPU run's; a family it did not predict keeps no ratio."""
    records, ops, again = {}, {}, {}
    for folder in folders:
        for record in read_records(folder / "population.jsonl"):
            records[record["family"]] = record
        for record in read_records(folder / "ops.jsonl"):
            ops[(record["family"], record["form"])] = record
        for record in read_records(folder / "predicted.jsonl"):
            again[record["family"]] = record
    if predicted:
        for family, record in records.items():
            forms = (again.get(family) or {}).get("forms") or {}
            for name, form in (record.get("forms") or {}).items():
                form.update(
                    predicted_peak_gib=(forms.get(name) or {}).get("predicted_peak_gib"),
                    measured_over_predicted=(forms.get(name) or {}).get("measured_over_predicted"),
                )
            if family in again:
                record["provenance"] = {**(record.get("provenance") or {}),
                                        "predicted again": again[family].get("provenance")}  # fmt: skip
    return records, ops


def _rows(records: dict[str, dict]) -> list[dict]:
    """One row per form measured with a ratio: family, set, class, form, ratio."""
    rows = []
    for record in records.values():
        for form, summary in (record.get("forms") or {}).items():
            ratio = summary.get("measured_over_predicted")
            if summary.get("status") == "ok" and isinstance(ratio, (int, float)):
                rows.append(dict(family=record["family"], set=record["set"], cls=class_of(record), form=form,
                                 ratio=ratio, summary=summary, band=_band(record)))  # fmt: skip
    return rows


def _band(record: dict) -> error_band.Band:
    """The band ray_zero states for a record's rows: its class's, checked against its GPU and the torch
    that ran it."""
    gpu = (record.get("gpu") or "").split(" x ")[-1] or None
    return error_band.band_for(class_of(record), gpu, (record.get("provenance") or {}).get("torch"))


def _stats_line(label: str, rows: list[dict]) -> str:
    """One line of the table: families, rows, median |ratio - 1|, within 5 %, range, under by > 5 %,
    inside the stated band, under-predicted beyond it."""
    ratios = [r["ratio"] for r in rows]
    if not ratios:
        return f"| {label} | 0 | 0 | | | | | | |"
    errors = [abs(r - 1) for r in ratios]
    within = sum(e <= OFF for e in errors)
    under = sum(r > 1 + OFF for r in ratios)
    inside = sum(r["band"].holds(r["ratio"]) for r in rows)
    beyond = sum(r["ratio"] > 1 + r["band"].upper for r in rows)
    families, median = len({r["family"] for r in rows}), 100 * statistics.median(errors)
    return (
        f"| {label} | {families} | {len(ratios)} | {median:.1f} % | {within} | "
        f"{min(ratios):.3f}-{max(ratios):.3f} | {under} | {inside} | {beyond} |"
    )


def _header(records: dict[str, dict]) -> list[str]:
    """The provenance once: each distinct machine and versions, the dates, the commands."""
    seen: dict[str, set[str]] = {}
    for record in records.values():
        provenance = record.get("provenance") or {}
        for key, value in provenance.items():
            seen.setdefault(key, set()).add(str(value))
    order = ["machine", "python", "torch", "deepspeed", "transformers", "timm", "date", "command"]
    lines = []
    for key in order + sorted(set(seen) - set(order)):
        if key in seen:
            values = sorted(seen[key])
            text = f"{values[0]} to {values[-1]}" if key == "date" and len(values) > 1 else "; ".join(values)
            lines.append(f"- {key}: {text}")
    return lines


def _hint(ops: dict | None) -> str:
    """What the op-by-op comparison says, in one cell."""
    if ops is None:
        return ""
    if ops.get("status") != "ok":
        return f"op by op failed: {ops.get('error', '')[:120]}"
    record = ops["ops"]
    meta, cuda = record["meta"], record["cuda"]
    alloc = record["allocator_rise_bytes"]
    top = lambda figures: ", ".join(f"{op} {b / GIB:.2f}" for op, b in figures["composition"][:3])  # noqa: E731
    return (
        f"rise meta {meta['rise_bytes'] / GIB:.2f} / CUDA ops {cuda['rise_bytes'] / GIB:.2f} / allocator "
        f"{alloc / GIB:.2f} GiB; SDPA CUDA {record.get('sdp_choices') or '-'}, "
        f"meta {meta['attention'] or '-'}; "
        f"at the peak, meta: {top(meta)}; CUDA: {top(cuda)}"
    )


def tables(folders: list[Path], predicted: bool = False) -> str:
    records, ops = load(folders, predicted)
    rows = _rows(records)
    out = [f"# The GPU population (issue 65): {len(records)} families, {len(rows)} rows with a ratio", ""]
    statuses: dict[str, int] = {}
    for record in records.values():
        statuses[record.get("status", "?")] = statuses.get(record.get("status", "?"), 0) + 1
    out += ["Families by status: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())), ""]
    for which in SETS:
        mine = [r for r in rows if r["set"] == which]
        families = {r["family"] for r in records.values() if r["set"] == which}
        out += [f"## {which}: {len(families)} families, {len(mine)} rows", ""]
        out += _header({f: r for f, r in records.items() if r["set"] == which}) + [""]  # its own parts
        out += [
            "| class / form | families | rows | median \\|measured/predicted − 1\\| | within 5 % | range | "
            "under-predicted > 5 % | inside the band | under beyond the band |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for cls in CLASSES:
            of_class = [r for r in mine if r["cls"] == cls]
            out.append(_stats_line(f"**{cls}**", of_class))
            for form in FORMS:
                out.append(_stats_line(f"{cls}: {form}", [r for r in of_class if r["form"] == form]))
        out.append(_stats_line("**all**", mine))
        off = sorted((r for r in mine if abs(r["ratio"] - 1) > OFF), key=lambda r: -abs(r["ratio"] - 1))
        out += ["", f"Rows off by more than 5 % ({len(off)}):", ""]
        if off:
            out += ["| family | form | measured/predicted | measured GiB | predicted GiB | op-by-op hint |"]
            out += ["|---|---|---|---|---|---|"]
        for r in off:
            s = r["summary"]
            out.append(
                f"| {r['family']} | {r['form']} | {r['ratio']:.3f} | {s['measured_peak_gib']:.2f} | "
                f"{s['predicted_peak_gib']:.2f} | {_hint(ops.get((r['family'], r['form'])))} |"
            )
        failed = []
        for name, record in sorted(records.items()):
            if record["set"] != which:
                continue
            if record.get("status") not in ("ok", "some forms failed"):  # stopped before its forms ended
                failed.append((name, "(family)", record))
            failed += [
                (name, form, f) for form, f in (record.get("forms") or {}).items() if f["status"] != "ok"
            ]
        out += ["", f"Not measured ({len(failed)}):", ""]
        out += [
            f"- {name} {form}: {f.get('status')}: {(f.get('error') or '')[:200]}" for name, form, f in failed
        ]
        out.append("")
    return "\n".join(out)
