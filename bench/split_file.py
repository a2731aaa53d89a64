"""A committed split of families into a tuning two-thirds and a held-out third, made once at random with a
committed seed, before any rule is fitted (bench/population_split.py for issue 65, bench/speed_split.py
for issue 67). Made again, it must give the same lists: a differing file is overwritten only with --force.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

from common import write_whole


def split(ids, seed: int) -> dict[str, list[str]]:
    """The ids sorted, shuffled with random.Random(seed), the first round(n / 3) held out."""
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    cut = round(len(order) / 3)
    return {"held_out": order[:cut], "tuning": order[cut:]}


def load(path: Path) -> dict:
    """A committed split: {"seed", "rule", "held_out": [...], "tuning": [...], ...}."""
    return json.loads(path.read_text())


def keep(path: Path, new: dict, describe: Callable[[dict], str], doc: str) -> int:
    """The command line of a split script: check `path` against the split made now (`new`), write it the
    first time or with --force, and say so (`describe`: the split's counts in words); its exit status."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--force", action="store_true", help="overwrite a committed split that differs")
    args = parser.parse_args()
    if path.is_file():
        old = load(path)
        if all(old.get(k) == new[k] for k in ("seed", "rule", "held_out", "tuning")):
            print(f"{path.name}: unchanged ({describe(new)})")
            return 0
        if not args.force:
            print(f"{path.name} differs from the split made now: left as it is (--force overwrites)")
            return 1
    write_whole(path, json.dumps(new, indent=1) + "\n")
    print(f"{path.name}: written ({describe(new)})")
    return 0
