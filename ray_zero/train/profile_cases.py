"""The cases `python -m ray_zero profile` times (train/profile_bench.py), per kernel class, small to large:
each generator yields (the point's row: shape, FLOPs and bytes as the profile reads them, the call to
time). torch only."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import conv_flop_count, sdpa_flop_count

from ray_zero.train.cuda_kernels import attention_kernel

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ADAM_BYTES = 28
"""An fp32 AdamW step per parameter: reads the parameter, its gradient and two moments, writes three."""

MATMULS = sorted(
    [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192)]
    + [(t, n, k) for t in (2048, 8192, 32768) for n, k in ((768, 768), (3072, 768), (768, 3072))]
    + [(t, n, k) for t in (2048, 8192) for n, k in ((50257, 768), (32000, 2048))],
    key=lambda s: s[0] * s[1] * s[2],
)
"""(M, N, K) of the matmul cases, by FLOPs: square, a transformer block's, and a vocabulary head's (GPT-2's
odd 50,257 columns, Llama's 32,000): a wide or misaligned output runs below a square of the same FLOPs."""
ATTENTIONS = sorted((seq, head) for seq in (256, 512, 1024, 2048, 4096, 8192) for head in (64, 128))
"""(sequence, head size) of the attention cases."""
CONVS = [
    (32, 3, 224, 64, 7, 2),
    (32, 64, 56, 64, 3, 1),
    (32, 256, 56, 64, 1, 1),
    (32, 128, 28, 128, 3, 1),
    (32, 256, 14, 256, 3, 1),
    (32, 512, 7, 512, 3, 1),
]
"""(batch, in channels, size, out channels, kernel, stride): ResNet-50's stem and stages."""
VECTOR_EXPONENTS = range(14, 29, 2)
"""log2 of the elementwise and reduction cases' elements: 16 K to 256 M."""
ADAMW_MILLIONS = (1, 4, 16, 64, 256)
"""Millions of parameters (2^20) of the optimizer step cases."""


def _matmul(device, dtype) -> Iterator:
    for m, n, k in MATMULS:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        moved = (m * k + k * n + m * n) * a.element_size()
        bucket = "head" if n > 16384 else "square" if m == n == k else "block"
        row = {"shape": [m, n, k], "bucket": bucket, "flops": 2 * m * n * k, "bytes": moved}
        yield row, lambda a=a, b=b: torch.mm(a, b)


def _attention(device, dtype) -> Iterator:
    for seq, head in ATTENTIONS:
        batch, heads = max(1, 8192 // seq), 2048 // head  # 8192 tokens of width 2048 a call
        q, k, v = (torch.randn(batch, heads, seq, head, device=device, dtype=dtype) for _ in range(3))
        row = {
            "shape": [batch, heads, seq, head],
            "flops": sdpa_flop_count(q.shape, k.shape, v.shape),
            "bytes": 4 * q.numel() * q.element_size(),
            "kernel": attention_kernel(q, k, v, None) if device.type == "cuda" else "cpu",
        }
        yield row, lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _conv(device, dtype) -> Iterator:
    for batch, cin, size, cout, kernel, stride in CONVS:
        x = torch.randn(batch, cin, size, size, device=device, dtype=dtype)
        w = torch.randn(cout, cin, kernel, kernel, device=device, dtype=dtype)
        out = F.conv2d(x, w, stride=stride, padding=kernel // 2)
        moved = (x.numel() + w.numel() + out.numel()) * x.element_size()
        row = {"shape": list(x.shape) + list(w.shape), "flops": conv_flop_count(x.shape, w.shape, out.shape)}
        yield (
            row | {"bytes": moved},
            lambda x=x, w=w, s=stride, p=kernel // 2: F.conv2d(x, w, stride=s, padding=p),
        )


def _elementwise(device, dtype) -> Iterator:
    for exponent in VECTOR_EXPONENTS:
        a = torch.randn(2**exponent, device=device, dtype=dtype)
        b = torch.empty_like(a)
        yield (
            {"shape": [a.numel()], "bytes": 2 * a.numel() * a.element_size()},
            lambda a=a, b=b: torch.mul(a, 2.0, out=b),
        )


def _random(device, dtype) -> Iterator:
    for exponent in VECTOR_EXPONENTS:
        a = torch.empty(2**exponent, device=device, dtype=dtype)
        yield {"shape": [a.numel()], "bytes": a.numel() * a.element_size()}, lambda a=a: a.bernoulli_(0.9)


def _reduction(device, dtype) -> Iterator:
    for exponent in VECTOR_EXPONENTS:
        a = torch.randn(2**exponent, device=device, dtype=dtype)
        yield {"shape": [a.numel()], "bytes": a.numel() * a.element_size()}, lambda a=a: a.sum()


def adamw_cases(device, kind: str) -> Iterator:
    for millions in ADAMW_MILLIONS:
        params = [torch.zeros(min(4, millions) * 2**20, device=device) for _ in range(max(1, millions // 4))]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-4, **{kind: True})
        count = sum(p.numel() for p in params)
        yield (
            {"shape": [len(params), params[0].numel()], "params": count, "bytes": ADAM_BYTES * count},
            optimizer.step,
        )


CASES = {
    "matmul": _matmul,
    "attention": _attention,
    "conv": _conv,
    "elementwise": _elementwise,
    "reduction": _reduction,
    "random": _random,
}


def case_count(kind: str) -> int:
    """A section's cases (read when it runs): those not timed within its share are listed as left out."""
    vectors = len(VECTOR_EXPONENTS)
    return {
        "matmul": len(MATMULS), "attention": len(ATTENTIONS), "conv": len(CONVS), "elementwise": vectors,
        "reduction": vectors, "random": vectors, "adamw": len(ADAMW_MILLIONS),
    }[kind]  # fmt: skip
