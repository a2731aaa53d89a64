"""The Python API without Ray: README shows examples/sweep_script.py as it is; the API's input forms and
its one-line errors before any Ray; estimate as a table. The script itself runs as README submits it, a
`ray job submit` on a two-node cluster, its Results read back: tests/test_cluster_use.py. The CLI is a
layer over the same functions (tests/test_sweep.py runs it as a user would)."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT

import ray_zero


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
    assert table.loc[(3, 8), "adam_gib"] < table.loc[(0, 8), "adam_gib"] / 7
    assert table.loc[(0, 1), "fits_16_gib"] == "no" and table.loc[(3, 8), "fits_16_gib"] == "yes"
    assert "805,888,010 parameters" in found.head and str(found).startswith(found.head)
