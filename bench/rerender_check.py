"""Every committed results folder re-rendered by `report` (pages and figures too), by this checkout alone
or beside another, compared.

Each folder (a trials.jsonl or trials.jsonl.gz under results/ or bench/results/) is copied to a scratch
folder and re-rendered by `python -m ray_zero report` run from a checkout. Alone, a folder passes when
`report` exits 0 and wrote report.html. With --other, it is copied twice, once per checkout, and passes
when both exit 0 and every cell of the other checkout's results.csv is the same in this one's (columns
this one adds aside, and those this one keeps in trials.jsonl only: the registry's record tier). Prints
one line per folder that does not pass, then the count.

    python bench/rerender_check.py [--other /path/to/older/checkout] [--scratch /tmp/rerender]
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ray_zero.schema import TRIAL  # noqa: E402


def render(folder: Path, checkout: Path, scratch: Path):
    """results.csv of `folder` re-rendered by `checkout`, or the last line of its error."""
    copy = scratch / checkout.name / folder.relative_to(ROOT)
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("tune*", "train"))
    done = subprocess.run(
        [sys.executable, "-m", "ray_zero", "report", str(copy)],
        capture_output=True,
        text=True,
        cwd=checkout,
        env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"},
    )
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        return lines[-1][:200] if lines else f"exit {done.returncode}"
    return pd.read_csv(copy / "results.csv")


def differences(old: pd.DataFrame, new: pd.DataFrame) -> list[str]:
    found = []
    for column in old.columns:
        if column not in new:
            if column not in TRIAL or TRIAL[column].tier != "record":
                found.append(f"column {column} gone")
            continue
        for i in range(len(old)):
            a, b = old.at[i, column], new.at[i, column]
            if isinstance(a, float) and isinstance(b, float):
                if (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-9 * max(1.0, abs(a)):
                    continue
            elif str(a) == str(b):
                continue
            found.append(f"{old.at[i, 'trial']}.{column}: {a} -> {b}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, help="another checkout of ray_zero")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/rerender"))
    args = parser.parse_args(argv)
    roots = ("results", "bench/results")
    folders = sorted({p.parent for r in roots for p in (ROOT / r).rglob("trials.jsonl*")})
    failing = 0
    for folder in folders:
        if args.other is None:
            new = render(folder, ROOT, args.scratch)
            drawn = args.scratch / ROOT.name / folder.relative_to(ROOT) / "report.html"
            problem = new if isinstance(new, str) else "" if drawn.is_file() else "no report.html"
            failing += bool(problem)
            if problem:
                print(f"{folder.relative_to(ROOT)}: {problem}")
            continue
        old, new = (render(folder, checkout, args.scratch) for checkout in (args.other.resolve(), ROOT))
        if isinstance(new, str) or isinstance(old, str):
            problem = f"this checkout: {new}" if isinstance(new, str) else f"the other: {old}"
        else:
            found = differences(old, new)
            problem = f"{len(found)} cells differ: {'; '.join(found[:3])}" if found else ""
        if problem:
            failing += 1
            print(f"{folder.relative_to(ROOT)}: {problem}")
    alike = "by this checkout" if args.other is None else "alike by both checkouts"
    print(f"{len(folders)} folders, {len(folders) - failing} re-rendered {alike}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
