"""bench/finetune_gpu.py's GPU run as issue 66 asks for it, checked on the meta device before a GPU spends
time on it: each family at its full size takes its LoRA targets and freeze patterns (a pattern that
matches nothing would fail the family on the GPU), each finetune kind has the four engines' rows, and the
token models have a seq_len grid of at least 4 values, up to 8,192 for the decoder, within its positions.
The tiny run end to end: `python bench/finetune_gpu.py --output DIR --tiny` (bench/finetune_gpu.md)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import finetune_gpu  # noqa: E402

from ray_zero.experiment_file import validate_experiment  # noqa: E402
from ray_zero.models.describe import describe_model  # noqa: E402


def test_every_family_at_full_size_takes_its_lora_and_freeze_patterns_and_has_every_form():
    grids = {}
    for name, family in finetune_gpu.FAMILIES.items():
        job = {"family": name, "tiny": False, "device": "gpu"}
        seq_len = finetune_gpu.seq_len_of(job)
        for kind, raw in finetune_gpu.experiment_dicts(job, micro=4, grid_micro=1).items():
            experiment = validate_experiment(raw, source=name)
            if experiment.grid.seq_len:
                grids[name] = sorted(experiment.grid.seq_len)
            # at the longest length: a seq_len beyond the model's positions is refused here
            length = max(experiment.grid.seq_len or [seq_len or 0]) or None
            model = describe_model(dataclasses.replace(experiment.model_source(), seq_len=length))
            assert 0 < model.trainable_params < model.params, (name, kind)
            if kind == "lora":  # r 16 on the attention projections only: a few per mille
                assert model.trainable_params < 0.02 * model.params, (name, model.trainable_params)
            else:  # the embeddings and half the blocks frozen
                assert 0.3 * model.params < model.trainable_params < 0.7 * model.params, (name, kind)
            points = finetune_gpu.points_of(kind, experiment, 4, seq_len, 1)
            engines = {(p.backend, p.stage) for p in points.values() if p.micro_batch_size == 4}
            assert engines == set(finetune_gpu.ENGINES.values()), (name, kind)
    assert set(grids) == {"llama", "bert"}
    assert all(len(grid) >= 4 for grid in grids.values()) and max(grids["llama"]) >= 8192
