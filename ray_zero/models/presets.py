"""The model's and the data's sizes, without torch: what the config, the memory model and the table rows
need, so that the driver can plan a sweep and the report can be rebuilt without torch.

Presets are rows of a size table, not copies of code: `seed` is the tutorial's model exactly
(274,698 parameters); `base` (~100 M) and `large` (805,888,010) are big enough for ZeRO's
partitioning of optimizer states to show.
"""

from __future__ import annotations

from dataclasses import dataclass

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


SAMPLE_BYTES = IMAGE_SIZE * IMAGE_SIZE * 4 + 8
"""One image sample on the device: float32 pixels and an int64 label."""
