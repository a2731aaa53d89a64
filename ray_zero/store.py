"""Where a sweep's record lives: trials.jsonl (one JSON line per finished trial, every rank included),
experiment.yaml (the experiment and its provenance), files written atomically, and a copy of the tables
at the storage path. Needs neither Ray nor torch.

Every file is written to a temporary name and renamed into place, so a crash mid-sweep never leaves a
truncated table behind.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ray_zero.schema import recorded_record, trial_record

EXPERIMENT_FILE = "experiment.yaml"
TRIALS_FILE = "trials.jsonl"
KEPT_TRIALS_FILE = TRIALS_FILE + ".gz"
"""trials.jsonl compressed, as a kept folder may hold it (the committed records); read as trials.jsonl."""
PUBLISHED = (
    "results.csv",
    "results.md",
    "per_rank.csv",
    "diagnostics.csv",
    "report.html",
    EXPERIMENT_FILE,
    TRIALS_FILE,
    "fit.csv",
    "fit.md",
    "best_ds_config.json",
    "best_config.json",
    "best_command.txt",
    "calibration.json",
)


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename over the target."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_trial(output_dir: Path, row: dict[str, Any]) -> None:
    """Append `row` to trials.jsonl, once it is checked against the column registry (RecordError if not)."""
    trial_record(row)
    with open(output_dir / TRIALS_FILE, "a") as record:
        record.write(json.dumps(row, default=str) + "\n")
        record.flush()
        os.fsync(record.fileno())


def trials_path(output_dir: Path) -> Path:
    """The folder's trials.jsonl, or its trials.jsonl.gz where only that is there (a kept folder)."""
    plain, kept = Path(output_dir) / TRIALS_FILE, Path(output_dir) / KEPT_TRIALS_FILE
    return kept if kept.is_file() and not plain.is_file() else plain


def has_trials(output_dir: Path) -> bool:
    return trials_path(output_dir).is_file()


def read_trials_text(output_dir: Path) -> str:
    """trials.jsonl's text, compressed or not; "" when the folder has none."""
    path = trials_path(output_dir)
    if not path.is_file():
        return ""
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def replace_trials(output_dir: Path, rows: list[dict[str, Any]]) -> None:
    """trials.jsonl rewritten with `rows` (each checked against the registry, an earlier version's own
    fields kept), atomically, compressed where it was: `report --predict` stores the prediction it made
    again."""
    for row in rows:
        recorded_record(row)
    text = "".join(json.dumps(row, default=str) + "\n" for row in rows)
    path = trials_path(output_dir)
    if path.suffix == ".gz":
        atomic_write_bytes(path, gzip.compress(text.encode(), mtime=0))
    else:
        atomic_write(path, text)


def repair_trials(output_dir: Path) -> bool:
    """Cut a half-written last line off trials.jsonl (the sweep's process killed while it wrote a row), so
    that the next row starts on its own line; whether there was one. That trial has no row: a resumed
    sweep runs it again."""
    path = output_dir / TRIALS_FILE
    if not path.is_file():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    with open(path, "r+b") as record:
        record.truncate(data.rfind(b"\n") + 1)
        record.flush()
        os.fsync(record.fileno())
    return True


def load_trials(output_dir: Path) -> list[dict[str, Any]]:
    """The latest row of each trial, from trials.jsonl or a kept folder's trials.jsonl.gz (a half-written
    last line, from a crash, is skipped)."""
    rows: dict[str, dict[str, Any]] = {}
    for line in read_trials_text(output_dir).splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows[row["trial"]] = row
    return list(rows.values())


def read_experiment_file(output_dir: Path) -> dict[str, Any]:
    """experiment.yaml as saved: {"experiment": {...}, "provenance": {...}}; {} when absent."""
    path = output_dir / EXPERIMENT_FILE
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def read_provenance(output_dir: Path) -> dict[str, Any] | None:
    return read_experiment_file(output_dir).get("provenance")


def join_storage(storage: str, name: str) -> str:
    """STORAGE/name, for a folder or a URI such as s3://bucket/path."""
    return f"{storage.rstrip('/')}/{name}" if "://" in storage else str(Path(storage) / name)


def publish(output_dir: Path, storage: str) -> None:
    """Copy the tables to STORAGE/results (a folder or a URI such as s3://bucket/sweep, via pyarrow),
    so that a sweep on a cluster leaves them beside its run state, reachable from every node."""
    from pyarrow import fs

    if "://" not in storage and Path(storage).resolve() == output_dir.resolve():
        return
    filesystem, target = fs.FileSystem.from_uri(join_storage(storage, "results"))
    filesystem.create_dir(target, recursive=True)
    for path in sorted(output_dir.iterdir()):
        if path.name in PUBLISHED or path.suffix == ".png":
            fs.copy_files(str(path), f"{target}/{path.name}", destination_filesystem=filesystem)


def cpu_name() -> str:
    """The host's CPU model, as provenance names it (/proc/cpuinfo; else the platform's words)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return cpu
