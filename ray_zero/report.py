"""Results of a sweep: results.csv, results.md, per_rank.csv and plots. Needs neither Ray nor a GPU.

Every file is written to a temporary name and renamed into place, so a crash mid-sweep never leaves
a truncated table behind.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import yaml

# Columns every row has, in this order (the core issue's list first; more after).
COLUMNS = [
    "stage", "micro_batch_size", "num_workers", "precision", "model", "params", "dataset", "steps",
    "status", "loss_first", "loss_last", "samples_per_s", "samples_per_s_per_worker",
    "peak_allocated_gib_max", "peak_reserved_gib_max", "optimizer_state_bytes_per_rank_max", "wall_s",
    "peak_allocated_gib_min", "peak_reserved_gib_min", "timed_peak_allocated_gib_max",
    "nvml_used_gib_max", "optimizer_state_bytes_per_rank_min", "parameter_bytes_per_rank_max",
    "gradient_bytes_per_rank_max", "master_param_bytes_per_rank_max", "other_optimizer_bytes_per_rank_max",
    "predicted_model_state_gib", "measured_model_state_gib", "predicted_peak_gib", "measured_over_predicted",
    "paper_model_state_gib", "tflops_per_worker", "mfu", "global_batch", "reduce_bucket_size", "timed_steps", "loss_by_epoch",
    "memory_kind", "device", "attempts", "queued_s", "timed_s", "model_build_s", "data_load_s", "initialize_s", "warmup_s",
    "data_source", "trial", "error",
]
# The Markdown table shows the columns a reader compares; results.csv has them all.
MARKDOWN_COLUMNS = [
    "stage", "micro_batch_size", "num_workers", "precision", "model", "params", "dataset", "steps",
    "status", "loss_first", "loss_last", "samples_per_s", "samples_per_s_per_worker",
    "peak_allocated_gib_max", "peak_allocated_gib_min", "peak_reserved_gib_max",
    "optimizer_state_bytes_per_rank_max", "predicted_peak_gib", "measured_over_predicted", "wall_s",
]
SORT_KEYS = ["stage", "micro_batch_size", "num_workers"]
EXPERIMENT_FILE = "experiment.yaml"
TRIALS_FILE = "trials.jsonl"
"""Every finished trial's row (every rank's report included), one JSON line each, appended as trials
finish: the record the tables are rebuilt from, also after an interrupted sweep is resumed."""


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_trial(output_dir: Path, row: dict[str, Any]) -> None:
    with open(output_dir / TRIALS_FILE, "a") as record:
        record.write(json.dumps(row, default=str) + "\n")
        record.flush()
        os.fsync(record.fileno())


def load_trials(output_dir: Path) -> list[dict[str, Any]]:
    """The latest row of each trial (a half-written last line, from a crash, is skipped)."""
    rows: dict[str, dict[str, Any]] = {}
    path = output_dir / TRIALS_FILE
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row["trial"]] = row
    return list(rows.values())


def rows_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame([{k: v for k, v in row.items() if k != "per_rank"} for row in rows])
    for column in COLUMNS:
        if column not in frame:
            frame[column] = None
    extra = [c for c in frame.columns if c not in COLUMNS]
    frame = frame[COLUMNS + extra]
    if len(frame):
        frame = frame.sort_values(SORT_KEYS, kind="stable").reset_index(drop=True)
    return frame


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) >= 10_000:
        value = int(value)  # byte counts in a column that also holds blanks
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}" if abs(value) < 100 else f"{value:.1f}"
    if isinstance(value, (int,)) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(frame: pd.DataFrame, columns: list[str] = MARKDOWN_COLUMNS) -> str:
    columns = [c for c in columns if c in frame]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, record in frame[columns].iterrows():
        lines.append("| " + " | ".join(_cell(record[c]) for c in columns) + " |")
    return "\n".join(lines)


def memory_note(frame: pd.DataFrame) -> str:
    kinds = set(frame["memory_kind"].dropna()) if "memory_kind" in frame else set()
    if kinds == {"cpu_rss"}:
        return ("Memory columns are each CPU worker process's peak resident set size (GiB), Python, torch "
                "and Ray included; not comparable with GPU memory. `measured_over_predicted` is left empty "
                "on CPU; `measured_model_state_gib` (tensors counted) is comparable with "
                "`predicted_model_state_gib`.")
    if kinds == {"cuda"}:
        return ("Memory columns are torch.cuda peak allocated / reserved bytes per rank (GiB), over the whole "
                "trial including `deepspeed.initialize`; _max and _min are over ranks.")
    return "Memory columns: peak CUDA allocated/reserved on GPU rows, peak resident set on CPU rows."


def render_markdown(frame: pd.DataFrame, provenance: dict[str, Any] | None) -> str:
    parts = [f"# {provenance.get('experiment', 'sweep') if provenance else 'sweep'}: results", ""]
    if provenance:
        parts += [f"- {key}: {value}" for key, value in provenance.items() if key != "experiment"]
        parts.append("")
    parts += [memory_note(frame), "", markdown_table(frame), ""]
    failures = frame[frame["status"].isin(["oom", "failed", "skipped"])] if len(frame) else frame
    if len(failures):
        parts += ["Not ok:", ""]
        parts += [f"- {r.trial}: {r.status}: {r.error}" for r in failures.itertuples()]
        parts.append("")
    return "\n".join(parts)


def write_results(output_dir: Path, rows: list[dict[str, Any]], provenance: dict[str, Any] | None) -> pd.DataFrame:
    """(Re)write results.csv, results.md and per_rank.csv atomically; return the table."""
    frame = rows_frame(rows)
    atomic_write(output_dir / "results.csv", frame.to_csv(index=False))
    atomic_write(output_dir / "results.md", render_markdown(frame, provenance))
    per_rank = [r for row in rows for r in row.get("per_rank") or []]
    if per_rank:
        atomic_write(output_dir / "per_rank.csv", pd.DataFrame(per_rank).to_csv(index=False))
    return frame


PUBLISHED = ("results.csv", "results.md", "per_rank.csv", EXPERIMENT_FILE, TRIALS_FILE,
             "memory.png", "throughput.png", "batch.png")


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
    for name in PUBLISHED:
        if (output_dir / name).is_file():
            fs.copy_files(str(output_dir / name), f"{target}/{name}", destination_filesystem=filesystem)


def read_provenance(output_dir: Path) -> dict[str, Any] | None:
    path = output_dir / EXPERIMENT_FILE
    if not path.is_file():
        return None
    return (yaml.safe_load(path.read_text()) or {}).get("provenance")


def load_results(output_dir: Path) -> pd.DataFrame:
    path = output_dir / "results.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{output_dir}: no results.csv here (give the --output folder of a sweep)")
    return pd.read_csv(path)


def rerender(output_dir: Path) -> pd.DataFrame:
    """`python -m ray_zero report DIR`: the tables and plots again, without Ray.

    From trials.jsonl (the measurements as recorded) when it is there, recomputing the derived columns
    (prediction, ratios) with this version of ray_zero; else from results.csv as it stands.
    """
    from ray_zero.plots import write_plots

    provenance = read_provenance(output_dir)
    rows = load_trials(output_dir)
    if rows:
        from ray_zero.rows import aggregate_ranks, finish_row

        experiment = yaml.safe_load((output_dir / EXPERIMENT_FILE).read_text())["experiment"]
        for row in rows:
            if row.get("per_rank"):
                row.update(aggregate_ranks(row["per_rank"]))
            row.setdefault("reduce_bucket_size", experiment["reduce_bucket_size"])
        frame = write_results(output_dir, [finish_row(row) for row in rows], provenance)
    else:
        frame = load_results(output_dir)
        atomic_write(output_dir / "results.md", render_markdown(frame, provenance))
    write_plots(frame, output_dir)
    return frame


def console_table(frame: pd.DataFrame) -> str:
    columns = ["trial", "status", "precision", "loss_first", "loss_last", "samples_per_s",
               "peak_allocated_gib_max", "predicted_peak_gib", "optimizer_state_bytes_per_rank_max", "wall_s"]
    shown = frame[[c for c in columns if c in frame]].copy()
    return shown.to_string(index=False, float_format=lambda v: f"{v:.4g}")
