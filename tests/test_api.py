"""The Python API as a script uses it: examples/sweep_script.py run on the test session's Ray (one
trial), its Results read back; the API's input forms and its one-line errors before any Ray; estimate
as a table. The CLI is a layer over the same functions (tests/test_sweep.py runs it as a user would)."""

from __future__ import annotations

import re
import runpy

import pytest
from conftest import ROOT

import ray_zero


def test_the_example_script_sweeps_on_the_sessions_ray(ray_instance, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    script = runpy.run_path(str(ROOT / "examples" / "sweep_script.py"))
    status = script["main"](
        [
            "--set",
            "grid.stage=[1]",
            "--set",
            "grid.num_workers=[1]",
            "--set",
            "steps=4",
            "--set",
            "warmup_steps=1",
            "--set",
            f"data_dir={tmp_path / 'mnist'}",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "ray_zero: stage1_mb64_w1: ok; loss" in out  # the console's line, through logging
    assert "stage1_mb64_w1: ok, peak" in out  # the script's own, from the returned table
    results = ray_zero.Results.read(tmp_path / "out")
    assert list(results.table["trial"]) == ["stage1_mb64_w1"] and list(results.per_rank["rank"]) == [0]
    assert {"results.csv", "per_rank.csv", "report.html", "trials.jsonl"} <= set(results.files)


def test_readme_shows_the_example_script_as_it_is():
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"examples/sweep_script.py\), complete:\n\n```python\n(.*?)```", readme, re.S).group(1)
    script = (ROOT / "examples" / "sweep_script.py").read_text()
    assert script.split('"""\n\n', 1)[1] == shown


def test_experiments_come_as_files_mappings_or_objects(tmp_path):
    from_file = ray_zero.experiment_of(ROOT / "experiments" / "quick.yaml", ["steps=5"])
    from_mapping = ray_zero.experiment_of({"model": "seed", "steps": 5})
    from_object = ray_zero.experiment_of(from_file, ["grid.stage=[3]"])
    assert from_file.steps == from_mapping.steps == 5 and from_object.grid.stage == [3]
    assert from_object.name == "quick" and from_file.grid.stage == [0, 1]  # the original is untouched
    with pytest.raises(ray_zero.ConfigError, match="^experiment: steps: should be greater than 0"):
        ray_zero.experiment_of({"steps": 0})
    with pytest.raises(ray_zero.ConfigError, match="^experiment must be a YAML path"):
        ray_zero.experiment_of(42)
    # Bad input is one line before Ray starts, through the API as through the CLI.
    with pytest.raises(ray_zero.ConfigError, match="fit on CPU needs --budget-gib"):
        ray_zero.fit(ROOT / "experiments" / "quick.yaml", overrides=["device=cpu"], output=tmp_path / "f")
    with pytest.raises(ray_zero.ConfigError, match="--resume DIR takes no experiment"):
        ray_zero.sweep("experiments/quick.yaml", resume=tmp_path)


def test_estimate_is_a_table():
    found = ray_zero.estimate("large", workers=[1, 8], stages=[0, 3], precision="bf16", gpu_gib=16)
    table = found.table.set_index(["stage", "workers"])
    assert table.loc[(3, 8), "states_gib"] < table.loc[(0, 8), "states_gib"] / 7
    assert table.loc[(0, 1), "fits_16_gib"] == "no" and table.loc[(3, 8), "fits_16_gib"] == "yes"
    assert "805,888,010 parameters" in found.head and str(found).startswith(found.head)
