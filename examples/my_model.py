"""Bring your own model: two factories ray_zero can train, and the protocol they follow.

An experiment names a factory as `model: path/to/file.py:function` (read from the working directory)
or `model: package.module:function`; ray_zero calls it with the experiment's `model_config` as keyword
arguments, once on the meta device to count parameters and FLOPs (so: build tensors with torch's
factory functions, no `.item()` or numpy at build time), and once per rank on the CPU after seeding torch.

    model: examples/my_model.py:build                # returns a ModelSpec: ray_zero needs nothing else
    model_config: {features: 64, width: 512, depth: 6}

    model: examples/my_model.py:build_classifier     # returns a plain nn.Module classifier
    model_config: {channels: 32}
    input_shape: [3, 32, 32]                         # ray_zero then makes random images of this shape,
    num_classes: 10                                  # uniform labels (10: the module has 10 outputs)

Check a factory without Ray: `python -c "from ray_zero.models.describe import describe_model as d;
print(d('examples/my_model.py:build'))"`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ray_zero.models.spec import ModelSpec


class ResidualBlock(nn.Module):
    """x + MLP(LayerNorm(x)): the repeated layer that FSDP2 shards and checkpointing recomputes."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """features -> width -> depth residual blocks -> one output: a regressor."""

    def __init__(self, features: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def build(features: int = 32, width: int = 256, depth: int = 4) -> ModelSpec:
    """A residual MLP regressing a fixed smooth function of its inputs, as a complete ModelSpec."""
    module = ResidualMLP(features, width, depth)

    def make_batch(n: int, device: torch.device, generator: torch.Generator):
        # Exactly n samples, drawn with ray_zero's generator (seeded per rank) on the rank's device.
        # Any tensor, tuple, list or dict of tensors will do: `loss` below is its only reader.
        x = torch.randn(n, features, device=device, generator=generator)
        # The target depends on x alone, so a repeated batch can be learned (its loss goes down).
        y = torch.sin(x).sum(dim=1) / math.sqrt(features)
        return x, y

    def loss(model, batch) -> torch.Tensor:
        # `model` is what the engine made of `module` (DeepSpeed engine, DDP or FSDP2): call it only.
        # ray_zero casts floating inputs to the engine's dtype (fp16/bf16): compute the loss in fp32.
        x, y = batch
        return F.mse_loss(model(x).float(), y.float())

    # blocks: the repeated layers. enable_checkpointing left out: ray_zero then recomputes each block with
    # torch.utils.checkpoint (ray_zero.models.source.checkpoint_blocks); give your own if it knows better.
    return ModelSpec(module=module, make_batch=make_batch, loss=loss, blocks=list(module.blocks))


def build_classifier(channels: int = 16) -> nn.Module:
    """A plain module: a small conv net mapping (n, 3, H, W) images to 10 logits. ray_zero finds its
    repeated layers (the Sequential of ConvBlocks) itself; the experiment gives input_shape and
    num_classes."""
    return nn.Sequential(
        nn.Conv2d(3, channels, kernel_size=3, padding=1),
        nn.Sequential(*(ConvBlock(channels) for _ in range(3))),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, 10),
    )


class ConvBlock(nn.Module):
    """x + conv(relu(norm(x))), shape-preserving."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.GroupNorm(1, channels)
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(F.relu(self.norm(x)))
