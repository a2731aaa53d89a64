"""The seed tutorial's small Vision Transformer for MNIST, and larger sizes of the same network.

Presets are rows of a size table, not copies of code: `seed` is the tutorial's model exactly
(274,698 parameters); `base` (~100 M) and `large` (805,888,010) are big enough for ZeRO's
partitioning of optimizer states to show. This file knows nothing of Ray or DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

IMAGE_SIZE = 28
NUM_CLASSES = 10


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a patch-embedding Transformer encoder classifier."""

    dim: int
    """Width of the token embeddings."""
    depth: int
    """Number of TransformerEncoderLayers."""
    heads: int
    """Attention heads per layer."""
    ff_dim: int
    """Hidden width of each layer's feed-forward block."""
    patch: int = 7
    """Side of the square patches (28 / 7 = 4, so 16 tokens)."""
    dropout: float = 0.1

    @property
    def num_patches(self) -> int:
        return (IMAGE_SIZE // self.patch) ** 2

    def param_count(self) -> int:
        """Parameters, counted from the shapes (tests check it against the built module)."""
        d, f, p = self.dim, self.ff_dim, self.patch
        embed = p * p * d + d + self.num_patches * d
        layer = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        head = d * NUM_CLASSES + NUM_CLASSES
        return embed + self.depth * layer + head

    def flops_per_sample(self) -> int:
        """Training FLOPs per sample (forward + backward = 3 x forward), from matmul shapes.

        Forward counts 2 FLOPs per multiply-add of every linear map and of attention's two
        batched products (scores and weighted sum); norms, softmax and activations are ignored.
        """
        t, d, f = self.num_patches, self.dim, self.ff_dim
        embed = 2 * t * (self.patch * self.patch) * d
        per_layer = 2 * t * (4 * d * d + 2 * d * f) + 2 * 2 * t * t * d
        head = 2 * d * NUM_CLASSES
        return 3 * (embed + self.depth * per_layer + head)


PRESETS: dict[str, ModelPreset] = {
    # The tutorial's model: dim 128, 2 layers, 4 heads, feed-forward 256.
    "seed": ModelPreset(dim=128, depth=2, heads=4, ff_dim=256),
    # About 100 M parameters: optimizer states (~1.2 GB in fp32 Adam) dominate a small batch.
    "base": ModelPreset(dim=1024, depth=8, heads=16, ff_dim=4096),
    # 805,888,010 parameters: ~12 GB of fp32 Adam states, where ZeRO-1 halves memory on 2 GPUs.
    "large": ModelPreset(dim=2048, depth=16, heads=16, ff_dim=8192),
}


class SmallTransformer(nn.Module):
    """Conv2d patch embedding -> learned positions -> TransformerEncoder -> mean pool -> linear head."""

    def __init__(self, preset: ModelPreset):
        super().__init__()
        self.patch_embed = nn.Conv2d(1, preset.dim, kernel_size=preset.patch, stride=preset.patch)
        self.pos_embed = nn.Parameter(torch.randn(1, preset.num_patches, preset.dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=preset.dim,
            nhead=preset.heads,
            dim_feedforward=preset.ff_dim,
            dropout=preset.dropout,
            batch_first=True,
        )
        # enable_nested_tensor only matters for padded inference; off avoids a warning.
        self.transformer = nn.TransformerEncoder(layer, num_layers=preset.depth, enable_nested_tensor=False)
        self.head = nn.Linear(preset.dim, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, 16, dim)
        tokens = self.transformer(tokens + self.pos_embed)
        return self.head(tokens.mean(dim=1))


def build_model(preset_name: str) -> SmallTransformer:
    return SmallTransformer(PRESETS[preset_name])
