"""The column registry and the typed records (ray_zero/schema/): every table, page and doc made from it,
a key it lacks refused where a row is written, no engine without its pieces, nothing guessed. Pure."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pandas as pd
import pytest
from rank_group import experiment_of, trial_spec

from ray_zero.config import Point, registered
from ray_zero.measure import meter, partitions
from ray_zero.measure.engine_memory import engine_prediction
from ray_zero.report.tables import rerender
from ray_zero.rows import aggregate_ranks, finish_row, trial_row
from ray_zero.schema import TRIAL, RecordError, rank_report
from ray_zero.schema.docs import columns_markdown
from ray_zero.store import append_trial, load_trials

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "results" / "zero1_mnist-h200"


@pytest.fixture
def renamed(monkeypatch):
    """Rename a trial column in the registry for one test (as an edit of trial_columns.py would)."""

    def rename(old: str, new: str) -> None:
        columns = tuple(dataclasses.replace(c, name=new) if c.name == old else c for c in TRIAL.columns)
        monkeypatch.setattr(TRIAL, "columns", columns)
        monkeypatch.setattr(TRIAL, "by_name", {c.name: c for c in columns})

    return rename


def test_a_column_renamed_in_the_registry_is_renamed_in_every_table_page_and_doc(renamed, tmp_path):
    folder = tmp_path / FOLDER.name
    shutil.copytree(FOLDER, folder)
    before = pd.read_csv(FOLDER / "results.csv")
    renamed("samples_per_s_per_worker", "samples_per_s_per_rank")
    rerender(folder)
    after = pd.read_csv(folder / "results.csv")
    assert "samples_per_s_per_worker" not in after and "samples_per_s_per_rank" in after
    # Made from the ranks' reports as the registry says: the same figures under the new name.
    assert list(after["samples_per_s_per_rank"]) == pytest.approx(list(before["samples_per_s_per_worker"]))
    page = (folder / "report.html").read_text()
    assert 'data-key="samples_per_s_per_rank"' in page and "samples_per_s_per_worker" not in page
    docs = columns_markdown()
    assert "`samples_per_s_per_rank`" in docs and "samples_per_s_per_worker" not in docs
    assert "samples_per_s_per_worker" not in (folder / "results.md").read_text()


def test_a_key_the_registry_lacks_is_refused_where_the_row_is_written(renamed, tmp_path):
    spec = trial_spec(experiment_of(ROOT / "experiments" / "quick.yaml"), Point("deepspeed", 1, 64, 2))
    row = finish_row({**trial_row(spec), "status": "ok", "wall_s": 3.0})
    (tmp_path / "written").mkdir()
    append_trial(tmp_path / "written", row)
    with pytest.raises(RecordError, match="wal_s: not a column of the registry"):
        append_trial(tmp_path, {**row, "wal_s": 3.0})
    # A column renamed in the registry but still written under its old name fails loudly too.
    renamed("wall_s", "wall_seconds")
    with pytest.raises(RecordError, match="wall_s: not a column"):
        append_trial(tmp_path, row)
    assert not (tmp_path / "trials.jsonl").exists() and len(load_trials(tmp_path / "written")) == 1


def test_records_keep_what_was_measured_and_refuse_a_wrong_type():
    report = {"rank": 0, "peak_allocated_gib": 0, "samples_per_s": 12.5, "steps": 4}
    assert rank_report(report) is report and report["peak_allocated_gib"] == 0  # not made 0.0
    with pytest.raises(RecordError, match="rank"):
        rank_report({"rank": "0"})
    # Rows of earlier versions still read, their other fields as they were.
    rows = load_trials(ROOT / "results" / "memory_scaling-h200x2")
    assert rows and all(r["status"] for r in rows)


def test_docs_columns_md_is_the_registrys():
    assert (ROOT / "docs" / "columns.md").read_text() == columns_markdown() + "\n"


def test_an_engine_without_its_pieces_fails_and_an_unknown_backend_is_refused():
    with pytest.raises(RuntimeError, match="no entry for engines \\['fsdp'\\]"):
        registered({"deepspeed": 1, "torch_zero": 2}, "memory models")
    with pytest.raises(ValueError, match="no memory model for backend 'megatron'"):
        engine_prediction("megatron", 1000, 1, 2, "bf16")
    with pytest.raises(ValueError, match="no partition rule for backend 'megatron'"):
        partitions.held([(10, 10)], [], "megatron", 1, 2)
    with pytest.raises(ValueError, match="no partition rule"):
        partitions.even(100, "megatron", 1, 2)


def test_a_failed_peak_reset_is_a_field_of_the_row(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(meter, "CLEAR_REFS", str(tmp_path))  # a folder: opening it to write fails
    measured = meter.Meter(torch.device("cpu"))
    measured.start_timing(1)
    measured.stop_timing(1, 8)
    assert measured.result()["peak_reset_failed"] is True
    assert aggregate_ranks([{"peak_reset_failed": False}, {"peak_reset_failed": True}])["peak_reset_failed"]


def test_a_cpu_folders_memory_column_is_headed_as_the_resident_set(tmp_path):
    """CPU rows (bench/results/cpu-2core/packing): results.md's and report.html's peak column says RSS, the
    GPU allocator's name stays results.csv's (one schema for CPU and GPU rows); GPU rows keep "peak GiB"."""
    cpu = tmp_path / "cpu"
    shutil.copytree(ROOT / "bench" / "results" / "cpu-2core" / "packing", cpu)
    rerender(cpu)
    lines = (cpu / "results.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| trial"))
    assert "| peak RSS GiB |" in header and "peak_allocated_gib_max" not in header
    assert 'data-key="peak_allocated_gib_max">peak RSS GiB</th>' in (cpu / "report.html").read_text()
    assert "peak_allocated_gib_max" in pd.read_csv(cpu / "results.csv")
    gpu = tmp_path / "gpu"
    shutil.copytree(FOLDER, gpu)
    rerender(gpu)
    assert 'data-key="peak_allocated_gib_max">peak GiB</th>' in (gpu / "report.html").read_text()
    assert "| peak_allocated_gib_max |" in (gpu / "results.md").read_text()
