"""The seed tutorial's small Vision Transformer for MNIST, and larger sizes of the same network.

The sizes (presets) live in `ray_zero.sizes`, which needs no torch. This file knows nothing of Ray or
DeepSpeed.
"""
from __future__ import annotations

import torch
from torch import nn

from ray_zero.sizes import NUM_CLASSES, PRESETS, ModelPreset


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
