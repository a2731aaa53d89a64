"""The families of every committed one-GPU row of an H100 or H200, split once, at random with a committed
seed, into a tuning two-thirds and a held-out third (issue 67), before any rule of the step-time
prediction is fitted: rules are chosen on the tuning rows only, and the held-out third is printed only in
a final run (bench/speed_accuracy.py --set all), so its figures are out of sample.

The rows: every trials.jsonl(.gz) under results/ and bench/results/ whose rows have memory_kind "cuda",
status "ok" and num_workers 1, on an H100 or H200 (the row's device_name, else its folder's
experiment.yaml provenance.driver_gpus). A family is the row's model (hf:gpt2, timm:resnet50, a preset
name) and, where one model appears at several sizes among these rows, its size in millions of parameters
(hf:bert 110M, hf:bert 335M), as bench/trace_accuracy.py's _family tells BERT-large apart. The family ids
sorted, shuffled with random.Random(SEED), the first round(n / 3) held out. The result is committed as
bench/speed_split.json; regenerating it must give the same lists, and a differing file is overwritten
only with --force (the split must never change silently).

    python bench/speed_split.py            # check (or write, the first time) speed_split.json
    python bench/speed_split.py --force    # overwrite a differing one: say why in the commit
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

import split_file
import yaml
from common import ROOT

SEED = 67
ROOTS = ("results", "bench/results")
SPLIT_FILE = ROOT / "bench" / "speed_split.json"
GPUS = ("h100", "h200")
RULE = (
    "rows: trials.jsonl(.gz) under results/ and bench/results/ with memory_kind 'cuda', status 'ok', "
    "num_workers 1, on an H100 or H200 (device_name, else experiment.yaml's provenance.driver_gpus). "
    "Family: the row's model, with its size in millions of parameters (the row's params) where the model "
    "appears at several sizes among these rows. Family ids sorted, shuffled with random.Random(seed), the "
    "first round(n / 3) held out, the rest tuning."
)


def _read(path: Path) -> list[dict]:
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _provenance(folder: Path) -> dict:
    path = folder / "experiment.yaml"
    return (yaml.safe_load(path.read_text()) or {}).get("provenance") or {} if path.is_file() else {}


def gpu_type(row: dict, provenance: dict) -> str:
    """h100, h200, another GPU's name, or cpu."""
    if row.get("memory_kind") != "cuda":
        return "cpu"
    name = str(row.get("device_name") or provenance.get("driver_gpus") or "?")
    return next((g for g in GPUS if g in name.lower()), name)


def committed_rows(memory_kind: str = "cuda", roots=ROOTS) -> list[dict]:
    """Every committed ok one-worker row of `memory_kind` ("cuda" or "cpu_rss"), each as {"folder" (relative
    to the checkout), "gpu", "family", "row"}, in the folders' order. A GPU other than an H100 or H200 is
    kept with its own name (the split leaves it out)."""
    out = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("trials.jsonl*")):
            provenance = None
            for row in _read(path):
                if row.get("memory_kind") != memory_kind or row.get("status") != "ok":
                    continue
                if row.get("num_workers") != 1:
                    continue
                provenance = _provenance(path.parent) if provenance is None else provenance
                folder = str(path.parent.relative_to(ROOT))
                out.append({"folder": folder, "gpu": gpu_type(row, provenance), "row": row})
    sizes: dict[str, set] = {}
    for r in out:
        sizes.setdefault(r["row"]["model"], set()).add(r["row"].get("params"))
    for r in out:
        model, params = r["row"]["model"], r["row"].get("params")
        several = len(sizes[model]) > 1
        r["family"] = f"{model} {params / 1e6:.0f}M" if several and params else model
    return out


def split_rows() -> list[dict]:
    """The rows the split is made over: one GPU, an H100 or H200."""
    return [r for r in committed_rows("cuda") if r["gpu"] in GPUS]


def split(ids, seed: int = SEED) -> dict[str, list[str]]:
    return split_file.split(ids, seed)


def counts(rows: list[dict], lists: dict[str, list[str]]) -> dict:
    """Rows and families on each side, and rows per GPU type."""
    side = {f: name for name, fams in lists.items() for f in fams}
    out = {}
    for name in ("tuning", "held_out"):
        mine = [r for r in rows if side.get(r["family"]) == name]
        out[name] = {
            "families": len(lists[name]),
            "rows": len(mine),
            "rows_by_gpu": dict(sorted(Counter(r["gpu"] for r in mine).items())),
        }
    return out


def made() -> dict:
    rows = split_rows()
    lists = split({r["family"] for r in rows})
    return {
        "seed": SEED,
        "rule": RULE,
        "roots": list(ROOTS),
        "date": dt.date.today().isoformat(),
        "counts": {"rows": len(rows), "families": len(lists["tuning"]) + len(lists["held_out"]),
                   **counts(rows, lists)},  # fmt: skip
        **lists,
    }


def load_split(path: Path = SPLIT_FILE) -> dict:
    return split_file.load(path)


def side_of(family: str, split_: dict) -> str:
    """tuning, held-out, or outside (a family the split does not name: a CPU row's, another GPU's)."""
    if family in split_["tuning"]:
        return "tuning"
    return "held-out" if family in split_["held_out"] else "outside"


def _say(content: dict) -> str:
    c = content["counts"]
    return "; ".join(
        f"{name}: {c[name]['families']} families, {c[name]['rows']} rows "
        f"({', '.join(f'{g} {n}' for g, n in c[name]['rows_by_gpu'].items())})"
        for name in ("tuning", "held_out")
    )


def main() -> int:
    return split_file.keep(SPLIT_FILE, made(), _say, __doc__)


if __name__ == "__main__":
    sys.exit(main())
