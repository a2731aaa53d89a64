"""A model that is not all trainable parameters: a frozen backbone with small trainable adapters, input
and output embeddings tied (one tensor), and buffers that are not parameters. What ray_zero does with each:

* frozen parameters (`requires_grad=False`, as a pretrained backbone you fine-tune adapters on): counted
  in `params` and held by every engine (cast to fp16/bf16 by DeepSpeed, sharded by ZeRO-3 and FSDP2),
  but they get no gradient, no fp32 master copy and no optimizer state. The memory model counts them so
  (ModelInfo.frozen_param_shapes); `describe_model` says how many there are.
* tied weights (`head.weight = embed.weight`): one tensor, counted once, one gradient, one Adam state.
* buffers (`register_buffer`): not parameters, so not in `params` nor in the model states; every rank
  keeps them whole. DeepSpeed (0.19.8) and FSDP2 leave floating buffers in fp32 while parameters train in
  fp16/bf16: cast a buffer to the activations' dtype where you use it (`positions` below), as
  Transformers does with RoPE's `inv_freq`.

    model: examples/adapter_model.py:build
    model_config: {vocab: 1000, width: 64, depth: 2, seq_len: 32}   # freeze_backbone: false trains it all

Check it without Ray: `python -c "from ray_zero.models.describe import describe_model as d;
print(d('examples/adapter_model.py:build'))"`. Its task: a fixed substitution cipher, each input token
to be mapped to another (a made-up task whose loss falls within a few steps).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ray_zero.models.spec import ModelSpec


class Adapter(nn.Module):
    """A bottleneck added beside a frozen layer (Houlsby et al. 2019); `up` starts at zero, so training
    starts from the backbone's function."""

    def __init__(self, width: int, bottleneck: int):
        super().__init__()
        self.down = nn.Linear(width, bottleneck)
        self.up = nn.Linear(bottleneck, width)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.gelu(self.down(x)))


class Block(nn.Module):
    """x + MLP(LayerNorm(x)) + adapter(x): the MLP and its norm frozen, the adapter trainable."""

    def __init__(self, width: int, bottleneck: int, freeze: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.adapter = Adapter(width, bottleneck)
        for frozen in (self.norm, self.mlp):
            frozen.requires_grad_(not freeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) + self.adapter(x)


class AdapterLM(nn.Module):
    """Token ids -> tied embedding + sinusoidal positions (a buffer) -> blocks -> norm -> tied head."""

    def __init__(
        self, vocab: int, width: int, depth: int, seq_len: int, bottleneck: int, freeze: bool = True
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's scale: a tied head's logits start small
        self.blocks = nn.ModuleList(Block(width, bottleneck, freeze) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter, listed once by parameters()
        position = torch.arange(seq_len, dtype=torch.float32)[:, None]
        frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(10000.0) / width))
        table = torch.zeros(seq_len, width)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
        self.register_buffer("positions", table)  # state, not a parameter: no gradient, never sharded

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.positions[: ids.shape[1]].to(x.dtype)  # the buffer may stay fp32 under fp16/bf16
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(
    vocab: int = 1000,
    width: int = 64,
    depth: int = 2,
    seq_len: int = 32,
    bottleneck: int = 16,
    freeze_backbone: bool = True,
) -> ModelSpec:
    """The adapter model and its task, as a ModelSpec: random token ids, each to be enciphered.
    freeze_backbone=False trains every parameter (the same model fully fine-tuned)."""
    module = AdapterLM(vocab, width, depth, seq_len, bottleneck, freeze_backbone)

    def make_batch(n: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, vocab, (n, seq_len), device=device, generator=generator)

    def loss(model, ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids).float()  # the loss in fp32 whatever the engine computes in
        targets = (ids * 7 + 1) % vocab  # a permutation of the vocabulary unless 7 divides vocab
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return ModelSpec(module=module, make_batch=make_batch, loss=loss, blocks=list(module.blocks))
