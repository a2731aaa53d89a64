"""bench/conformance.py's table (docs/conformance.md) from its records: each engine's verdict on each model,
the failures grouped by cause, the Transformers types the shrink fell back for.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from common import versions, write_whole
from conformance_check import ENGINE_TITLES, ENGINES

RESULTS_FILE, POPULATION_FILE = "results.jsonl", "population.json"
PACKAGES = ("torch", "transformers", "timm", "deepspeed")
"""The versions a run records."""


def engine_result(engine: Optional[dict]) -> tuple[str, str]:
    """An engine's verdict on a model and, unless it passed, the one-line reason: the first check that
    failed (training, the loss, the model states, the calibration)."""
    if engine is None:
        return "not run", ""
    if engine["status"] != "ok":
        return "training fails", engine.get("error") or engine["status"]
    first, last = engine.get("loss_first"), engine.get("loss_last")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (first, last)):
        return "loss not finite", f"loss {first} at the first step, {last} at the last"
    off = [
        f"{state} measured {check['measured']}, predicted {check['predicted']:.0f}"
        for state, check in engine["states"].items()
        if not check["ok"]
    ]
    if off:
        return "states differ", "; ".join(off)
    fit = engine.get("calibration")
    if fit is None:
        return "not calibrated", "calibration did not finish"
    if "skipped" in fit:
        return "pass", ""
    if fit["verdict"] != "ok":
        errors = f" ({'; '.join(fit['errors'])})" if fit["errors"] else ""
        word = "calibration fails" if fit["errors"] else "calibration doubtful"
        return word, f"calibration at stage {fit['stage']}: {fit['verdict']}{errors}"
    return "pass", ""


def model_results(record: dict) -> tuple[dict[str, str], str]:
    """Each engine's word for the model, and the reason of its failures in one line."""
    if record["status"] not in ("checked", "timeout", "worker died"):  # described or not, not trained
        return {b: record["status"] for b, _ in ENGINES}, str(record.get("error"))
    results = {b: engine_result(record.get("engines", {}).get(b)) for b, _ in ENGINES}
    if record["status"] != "checked":  # what it did before it was stopped, and where it stopped
        results = {
            b: (word, reason)
            if word not in ("not run", "not calibrated")
            else (record["status"], record["error"])
            for b, (word, reason) in results.items()
        }
    words = {b: word for b, (word, _) in results.items()}
    reasons = [(b, reason) for b, (_, reason) in results.items() if reason]
    if len({reason for _, reason in reasons}) == 1:
        return words, reasons[0][1]
    return words, "; ".join(f"{ENGINE_TITLES[b]}: {reason}" for b, reason in reasons)


def summary_line(record: dict) -> str:
    words, reason = model_results(record)
    params = f"{record['params']:,} params, " if record.get("params") else ""
    return f"{params}" + ", ".join(f"{b} {w}" for b, w in words.items()) + (f" ({reason})" if reason else "")


def cause_of(reason: str) -> str:
    """A failure's cause, for grouping: the reason without what differs from model to model (numbers,
    names in quotes, the class names of the model)."""
    text = re.sub(r"^(rank \d+: )", "", reason)
    text = re.sub(r"0x[0-9a-f]+", "ADDR", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(
        r"\b[A-Z][A-Za-z0-9]*(Model|Config|ForCausalLM|ForMaskedLM|Layer|Attention)\w*", "Class", text
    )
    return re.sub(r"\d+", "N", text)[:200]


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def read_records(output: Path) -> dict[str, dict]:
    """The latest record of each model (a retried model's last)."""
    path = output / RESULTS_FILE
    records = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                records[record["id"]] = record
    return records


def write_table(output: Path, table: Path) -> str:
    records = read_records(output)
    path = output / POPULATION_FILE
    # The models of a run with --only in a folder of its own are what its records hold.
    population = json.loads(path.read_text()) if path.is_file() else list(records.values())
    log = output / "runs.jsonl"
    runs = (
        [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    )
    full = [r for r in runs if not r.get("only")] or runs
    took = sum(r.get("wall_s", 0) for r in runs)
    last = runs[-1] if runs else {"versions": versions(PACKAGES)}  # a run still going has written none yet
    dates = sorted(r["finished"][:10] for r in records.values())
    lines = [
        "# Conformance: the model families a user may bring",
        "",
        "Written by `bench/conformance.py` (issue 42; bench/conformance.md tells the story). Each model: "
        "described on the meta device, then trained 3 steps in bf16 (micro-batch 2, one CPU rank under "
        "gloo, as a sweep's rank) on DeepSpeed ZeRO-1 and FSDP2 (stage 3), then calibrated on the "
        "first engine that trained it, at its smallest stage (DeepSpeed 0, else FSDP2 2), at three "
        "micro-batches of about 4, 8 and 12 MiB of activations. **pass**: the loss is finite, the four "
        "kinds of model-state bytes are the memory model's (to the byte; Adam's step counters aside), "
        "and, on the engine calibrated, the calibration's verdict is ok. timm models at 96x96 where they "
        "take it (the input column), Transformers types shrunk to 2 layers of width 64 (seq_len 32, images "
        "64x64) where their configuration allows.",
        "",
        f"- Hardware: {last.get('machine', '?')} (a 2-core CPU VM shared with other work; bf16 without "
        f"native support), one worker process a model, `--jobs` at a time, `nice -n 19`; reruns' records "
        f"appended to the first run's results.jsonl",
        f"- Run: {dates[0] if dates else '-'} to {dates[-1] if dates else '-'}, "
        f"{took / 3600:.1f} h over {len(runs)} invocation(s)",
        *(f"- Command: `{r['command']}`" for r in full[:1] + [r for r in runs if r.get("only")]),
        f"- ray_zero: {last.get('ray_zero', '?')}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in last["versions"].items()),
        "",
    ]
    sections = (
        ("timm", "timm: the smallest model of each family (module)"),
        ("transformers", "Transformers: each model type, shrunk"),
    )
    summary, causes, fallbacks = [], defaultdict(dict), []
    body: list[str] = []
    for source, title in sections:
        mine = [c for c in population if c["source"] == source]
        found = [records[c["id"]] for c in mine if c["id"] in records]
        passes = {b: sum(model_results(r)[0][b] == "pass" for r in found) for b, _ in ENGINES}
        summary.append(
            f"- {source}: {len(found)} of {len(mine)} {'families' if source == 'timm' else 'types'} run; "
            + ", ".join(f"{ENGINE_TITLES[b]} passes {n}" for b, n in passes.items())
            + f"; both pass {sum(set(model_results(r)[0].values()) == {'pass'} for r in found)}"
        )
        body += ["", f"## {title}", ""]
        first = "family | model" if source == "timm" else "type | task"
        body.append(
            f"| {first} | params | " + " | ".join(ENGINE_TITLES[b] for b, _ in ENGINES) + " | reason |"
        )
        body.append("|---" * (4 + len(ENGINES)) + "|")
        for case in mine:
            record = records.get(case["id"])
            if record is None:
                continue
            words, reason = model_results(record)
            name = case["model"].split(":", 1)[1] if source == "timm" else case["task"]
            shrink = record.get("shrink") or case.get("shrink") or "shrunk"
            if source == "transformers" and shrink != "shrunk":
                name += f" ({shrink})"
                fallbacks.append({**case, **record, "shrink": shrink})
            if source == "timm":
                size = (record.get("input_shape") or [None])[-1]
                size = size or (record.get("model_config") or {}).get("img_size")
                name += f" ({size}x{size})" if size else " (default size)"
            params = f"{record['params']:,}" if record.get("params") else "-"
            body.append(
                f"| {case['family']} | {name} | {params} | "
                + " | ".join(words[b] for b, _ in ENGINES)
                + f" | {_cell(reason)} |"
            )
            for backend, (word, why) in _by_engine(record).items():
                if word != "pass":
                    hits = causes[(word, cause_of(why))]
                    hits.setdefault(case["id"], []).append(backend)
                    hits.setdefault("", why)  # the first model's own line
    lines += ["## Summary", "", *summary, "", "## Failures by cause", ""]
    lines += ["| check | models (engines) | models | an error line |", "|---|---|---|---|"]
    for (word, _), hits in sorted(causes.items(), key=lambda item: -len(item[1])):
        example = hits.pop("")
        models = ", ".join(
            m + ("" if len(engines) == len(ENGINES) else f" ({', '.join(engines)})")
            for m, engines in hits.items()
        )
        lines.append(f"| {word} | {_cell(models)} | {len(hits)} | {_cell(example)} |")
    lines += [
        "",
        "## Transformers types the harness could not shrink",
        "",
        "Each type takes the first of: every size key shrunk, the layer counts, vocabulary and experts only "
        "(layers), the configuration class's defaults (default); the levels before it failed to describe:",
        "",
        "| type | level | params | the full shrink's error |",
        "|---|---|---|---|",
    ]
    for case in fallbacks:
        params = f"{case['params']:,}" if case.get("params") else "-"
        refused = case.get("shrink_refused", {}).get("shrunk", "") or "(see the record)"
        lines.append(f"| {case['family']} | {case['shrink']} | {params} | {_cell(refused)} |")
    text = "\n".join(lines + body) + "\n"
    table.parent.mkdir(parents=True, exist_ok=True)
    write_whole(table, text)
    return "\n".join(summary)


def _by_engine(record: dict) -> dict[str, tuple[str, str]]:
    words, _ = model_results(record)
    if record["status"] not in ("checked", "timeout", "worker died"):
        return {b: (w, str(record.get("error"))) for b, w in words.items()}
    out = {}
    for backend, word in words.items():
        reason = engine_result(record.get("engines", {}).get(backend))[1] or record.get("error") or ""
        out[backend] = (word, reason)
    return out

