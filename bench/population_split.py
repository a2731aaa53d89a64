"""The GPU population's families split once, at random with a committed seed, into a tuning two-thirds and a
held-out third (issue 65): the tracer's rules are found on the tuning families only, and the held-out
third is measured again only at the end, so its figures are out of sample.

The families: every timm family of the conformance population (the smallest model of each timm module)
and every Transformers type the conformance run trained (status "checked", at least one engine "ok"), read
from bench/results/conformance-cpu-2core/. The family ids sorted, shuffled with random.Random(SEED), the
first third (rounded) held out. The result is committed as bench/population_split.json; regenerating it
must give the same lists, and a differing file is overwritten only with --force (the split must never
change silently).

    python bench/population_split.py            # check (or write, the first time) population_split.json
    python bench/population_split.py --force    # overwrite a differing one: say why in the commit
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import sys
from pathlib import Path

import split_file
from common import ROOT

SEED = 65
CONFORMANCE = ROOT / "bench" / "results" / "conformance-cpu-2core"
SPLIT_FILE = ROOT / "bench" / "population_split.json"
RULE = (
    "families: every timm family of population.json; every Transformers type whose record in "
    "results.jsonl.gz has status 'checked' and at least one engine with status 'ok'. Family ids "
    "(timm:MODULE, hf:TYPE) sorted, shuffled with random.Random(seed), the first round(n / 3) held out, "
    "the rest tuning."
)


def family_id(case: dict) -> str:
    """timm:MODULE or hf:TYPE: the unit of the split (a family, not a model or a row)."""
    return f"{'timm' if case['source'] == 'timm' else 'hf'}:{case['family']}"


def trained(record: dict) -> bool:
    return record.get("status") == "checked" and any(
        engine.get("status") == "ok" for engine in (record.get("engines") or {}).values()
    )


def families(folder: Path = CONFORMANCE) -> dict[str, dict]:
    """Each family kept, by id: its conformance case (population.json's)."""
    population = json.loads((folder / "population.json").read_text())
    with gzip.open(folder / "results.jsonl.gz", "rt") as lines:
        records = {r["id"]: r for r in map(json.loads, filter(str.strip, lines))}
    kept = [c for c in population if c["source"] == "timm" or trained(records.get(c["id"], {}))]
    return {family_id(c): c for c in kept}


def split(ids, seed: int = SEED) -> dict[str, list[str]]:
    return split_file.split(ids, seed)


def made() -> dict:
    kept = families()
    lists = split(kept)
    return {
        "seed": SEED,
        "rule": RULE,
        "source": str(CONFORMANCE.relative_to(ROOT)),
        "date": dt.date.today().isoformat(),
        "counts": {
            "families": len(kept),
            "timm": sum(i.startswith("timm:") for i in kept),
            "transformers": sum(i.startswith("hf:") for i in kept),
            "held_out": len(lists["held_out"]),
            "tuning": len(lists["tuning"]),
        },
        **lists,
    }


def load_split(path: Path = SPLIT_FILE) -> dict:
    return split_file.load(path)


def main() -> int:
    return split_file.keep(SPLIT_FILE, made(), lambda new: str(new['counts']), __doc__)


if __name__ == "__main__":
    sys.exit(main())
