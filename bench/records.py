"""The committed records (results/, bench/results/) in the form they are kept: data, not renders.

A kept run folder holds experiment.yaml, trials.jsonl.gz (trials.jsonl compressed; `report` reads either),
results.csv, results.md, per_rank.csv, and fit.csv, fit.md, best_* and calibration.json where they were
written. report.html and the PNG figures are not kept: `python -m ray_zero report DIR` draws them again
(.gitignore keeps them out of git). The lab's raw files beside them are compressed where they are large:
console logs and nvidia-smi samples over KEEP_PLAIN_BYTES gzipped, DeepSpeed autotuner's experiment trees
packed into one .tar.gz each (`tar xzf` to read them again).

    python bench/records.py keep FOLDER [FOLDER ...]   # a new run's folder, before it is committed
    python bench/records.py population RUN DEST        # bench/population_gpu.py's output, kept in DEST
    python bench/records.py sizes                      # the checkout's size without .git, and the records'

The GPU population (hundreds of families, a run folder each) is kept as its records alone: population.jsonl,
ops.jsonl and predicted.jsonl gzipped, and every family's rows (its trials.jsonl, each row with its
family) in one rows.jsonl.gz; the run folders stay out of git. To add parts in a fresh checkout, seed the
run folder with the kept files (`mkdir -p runs/population-h100 && cp bench/results/population-h100/*
runs/population-h100/`): the driver skips the families kept there, and keeping the folder again merges.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ("results", "bench/results")
RENDERS = ("report.html", "*.png")
KEEP_PLAIN_BYTES = 8 * 1024
"""A raw log or sample file larger than this is gzipped (each is read at most by a bench script)."""
RAW = ("*.log", "gpu_log*.csv")
PACKED_TREES = ("autotuning_exps", "autotuning_results")


def gzip_file(path: Path) -> Path:
    """`path` replaced by path.gz (no timestamp inside: the same bytes each time)."""
    target = path.with_name(path.name + ".gz")
    target.write_bytes(gzip.compress(path.read_bytes(), compresslevel=9, mtime=0))
    path.unlink()
    return target


def pack_tree(folder: Path) -> Path:
    """`folder` replaced by folder.tar.gz, its files in name order."""
    target = folder.with_name(folder.name + ".tar.gz")
    with tarfile.open(target, "w:gz", compresslevel=9) as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(folder.parent)), recursive=False)
    subprocess.run(["rm", "-r", str(folder)], check=True)
    return target


def keep(folder: Path) -> list[str]:
    """`folder` (and the run folders under it) in its kept form; what changed, a line each."""
    done = []
    for pattern in RENDERS:
        for path in sorted(folder.rglob(pattern)):
            path.unlink()
            done.append(f"removed {path}")
    for path in sorted(folder.rglob("trials.jsonl")):
        done.append(f"gzipped {gzip_file(path)}")
    for pattern in RAW:
        for path in sorted(folder.rglob(pattern)):
            if path.stat().st_size > KEEP_PLAIN_BYTES:
                done.append(f"gzipped {gzip_file(path)}")
    for name in PACKED_TREES:
        for tree in sorted(p for p in folder.rglob(name) if p.is_dir()):
            done.append(f"packed {pack_tree(tree)}")
    return done


def keep_population(run: Path, dest: Path) -> list[str]:
    """bench/population_gpu.py's output folder `run` kept in `dest` as its records (module docstring). A
    `run` seeded with kept records (their .gz files copied in, to resume in a fresh checkout) keeps them
    too: its records are the kept ones and the lines appended since, and rows.jsonl.gz keeps the families
    whose run folders are not there."""
    import json

    from population_table import read_records

    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for name in ("population.jsonl", "ops.jsonl", "predicted.jsonl"):
        records = read_records(run / name)
        if records:
            target = dest / (name + ".gz")
            text = "".join(json.dumps(record) + "\n" for record in records)
            target.write_bytes(gzip.compress(text.encode(), 9, mtime=0))
            done.append(f"kept {target}")
    if (run / "gpu.txt").is_file():
        (dest / "gpu.txt").write_bytes((run / "gpu.txt").read_bytes())
        done.append(f"kept {dest / 'gpu.txt'}")
    folders = sorted(run.glob("*/trials.jsonl"))
    here = {trials.parent.name for trials in folders}
    rows = []
    if (run / "rows.jsonl.gz").is_file():  # seeded: the kept families not run again
        kept = gzip.decompress((run / "rows.jsonl.gz").read_bytes()).decode().splitlines()
        rows = [line for line in kept if line.strip() and json.loads(line)["family_folder"] not in here]
    for trials in folders:
        for row in trials.read_text().splitlines():
            rows.append(json.dumps({"family_folder": trials.parent.name, **json.loads(row)}))
    (dest / "rows.jsonl.gz").write_bytes(gzip.compress(("\n".join(rows) + "\n").encode(), 9, mtime=0))
    families = len({json.loads(row)["family_folder"] for row in rows})
    done.append(f"kept {len(rows)} rows of {families} families in {dest / 'rows.jsonl.gz'}")
    return done


def run_folders() -> list[Path]:
    """Every committed folder `report` renders (it holds trials.jsonl or trials.jsonl.gz)."""
    return sorted({p.parent for root in RECORDS for p in (ROOT / root).rglob("trials.jsonl*")})


def sizes() -> str:
    """The tracked files' bytes, and the disk they take (whole blocks, as du counts), records apart."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / name for name in tracked.decode().split("\0") if name and (ROOT / name).is_file()]
    stats = [(p.stat(), str(p.relative_to(ROOT)).startswith(RECORDS)) for p in files]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    apparent, disk = sum(s.st_size for s, _ in stats), sum(s.st_blocks * 512 for s, _ in stats)
    records = sum(s.st_size for s, kept in stats if kept)
    return (
        f"{len(files)} tracked files: {mib(apparent)} ({mib(disk)} on disk); the records {mib(records)} in "
        f"{len(run_folders())} run folders"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("keep").add_argument("folders", nargs="+", type=Path)
    population = verbs.add_parser("population")
    population.add_argument("run", type=Path)
    population.add_argument("dest", type=Path)
    verbs.add_parser("sizes")
    args = parser.parse_args(argv)
    if args.verb == "keep":
        for folder in args.folders:
            if not folder.is_dir():
                print(f"records: {folder}: not a folder", file=sys.stderr)
                return 2
            for line in keep(folder):
                print(f"records: {line}")
    elif args.verb == "population":
        for line in keep_population(args.run, args.dest):
            print(f"records: {line}")
    else:
        print(sizes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
