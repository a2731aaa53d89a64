"""On the meta device, the kernels a CUDA device would run where the choice changes what a step keeps.

A traced step (ray_zero/train/step_trace.py) runs on meta tensors. Some of torch's composite operators
choose their kernel by the tensors' device, and on meta they take paths a GPU does not, keeping other
tensors; `autocast("cuda")` turns itself off without a GPU. `cuda_kernels(autocast)` puts back, for
memory, what a CUDA device (sm80 or newer) does:

- `scaled_dot_product_attention`: the fused kernel CUDA picks (`attention_kernel`: flash for fp16/bf16
  without a mask and a head of at most 256 elements, else memory-efficient where the head is aligned and
  the mask does not require grad, else the math path). A fused kernel keeps the output and a log-sum-exp
  per row, not the attention matrix that the math path keeps;
- autocast (`autocast=dtype`): CUDA autocast's rules, applied by the mode: matmuls and convolutions in
  the low dtype (a leaf parameter's cast made once per forward and kept, as autocast's cache keeps it),
  normalisations, softmax, losses and the pointwise functions CUDA runs in fp32 in fp32.

Dropout's mask (1 byte an element from CUDA's fused kernel, the input's dtype on meta) is counted by the
tracker itself, which sees every operator. On a CUDA device nothing is changed. torch only.

A checkpointed block is run again in backward, where torch runs no function mode: the mode is entered
again for it (a module called where it is not active), with autocast's cache of its own, as
torch.utils.checkpoint enters autocast afresh for the recompute.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

LOW = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD = 256
_SDPA = F.scaled_dot_product_attention


def attention_kernel(query, key, value, attn_mask, enable_gqa: bool = False) -> str:
    """"flash", "efficient" or "math": what CUDA's scaled_dot_product_attention runs for these inputs
    (torch's sdp_utils.cpp; the checks that decide what is kept)."""
    low = query.dtype in LOW
    heads = query.shape[-1], key.shape[-1], value.shape[-1]
    if low and attn_mask is None and len(set(heads)) == 1 and heads[0] <= FLASH_MAX_HEAD:
        return "flash"
    if attn_mask is not None and attn_mask.requires_grad:
        return "math"  # a mask that learns (T5's position bias): its saved step matched the math path
    alignment = 8 if low else 4
    grouped = enable_gqa and query.shape[-3] != key.shape[-3]
    if not grouped and heads[0] == heads[1] and heads[0] % alignment == 0 and heads[2] % alignment == 0:
        return "efficient"
    return "math"


def cuda_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """scaled_dot_product_attention through the kernel CUDA would pick (on meta tensors; elsewhere the
    function itself)."""
    if query.device.type != "meta":
        return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    kind = attention_kernel(query, key, value, attn_mask, enable_gqa)
    _CHOICES[kind] = _CHOICES.get(kind, 0) + 1
    if kind == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
    if kind == "efficient":
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device="meta").masked_fill(
                    ~attn_mask, float("-inf")
                )
            attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]
    return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


_CHOICES: dict[str, int] = {}

_T = torch.Tensor


def _present(*functions) -> frozenset:
    return frozenset(f for f in functions if f is not None)


LOWER = _present(
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.prelu, torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm,
    torch.bmm, _T.bmm, torch.baddbmm, _T.baddbmm, torch.addmm, _T.addmm, torch.addbmm, torch.addmv,
    torch.addr, torch.mv, _T.mv, torch.einsum, torch.chain_matmul, torch.linalg.multi_dot,
    torch.linalg.vecdot, torch.conv1d, torch.conv2d, torch.conv3d, _SDPA,
)  # fmt: skip
"""CUDA autocast's lower-precision operators, by the Python functions that reach them (ATen's
autocast_mode.h; grouped matmuls are not among them: an fp32 weight computes in fp32)."""
FP32 = _present(
    F.layer_norm, F.group_norm, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.kl_div, F.binary_cross_entropy_with_logits, F.softplus, F.cosine_similarity, F.interpolate,
    getattr(F, "rms_norm", None), torch.layer_norm, torch.group_norm, torch.exp, _T.exp, torch.log, _T.log,
    torch.log1p, _T.log1p, torch.log2, torch.log10, torch.expm1, torch.pow, _T.pow, _T.__pow__,
    torch.rsqrt, _T.rsqrt, torch.reciprocal, _T.reciprocal, torch.erfinv, torch.acos, torch.asin,
    torch.cosh, torch.sinh, torch.tan, torch.logsumexp, _T.logsumexp, torch.cdist, torch.dist,
)  # fmt: skip
"""CUDA autocast's fp32 operators: their floating inputs cast to fp32."""
FP32_OUTPUT = _present(
    F.softmax, F.log_softmax, torch.softmax, _T.softmax, torch.log_softmax, _T.log_softmax, torch.sum,
    _T.sum, torch.cumsum, _T.cumsum, torch.cumprod, _T.cumprod, torch.prod, _T.prod,
    torch.linalg.vector_norm,
)  # fmt: skip
"""CUDA autocast's fp32_set_opt_dtype operators: run with dtype=fp32 (an fp32 output, the input as it is)."""


def _low(args) -> bool:
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype in LOW


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                   reduction="mean", label_smoothing=0.0):  # fmt: skip
    """cross_entropy under autocast, as its parts run: ATen's cross_entropy_loss asks log_softmax for the
    input's own dtype (so it stays in half precision), and nll_loss, an fp32 operator, takes an fp32 copy."""
    if label_smoothing:
        return F.cross_entropy(
            input.float(), target, weight, None, ignore_index, None, reduction, label_smoothing
        )
    log_probabilities = F.log_softmax(input, 1 if input.dim() > 1 else 0, dtype=input.dtype)
    weight = weight.float() if weight is not None else None
    return F.nll_loss(log_probabilities.float(), target, weight, None, ignore_index, None, reduction)


class _CudaMode(TorchFunctionMode):
    """Attention through `cuda_attention` for callers holding the function itself; with `autocast`,
    CUDA autocast's casts."""

    def __init__(self, autocast: Optional[torch.dtype]):
        super().__init__()
        self.autocast = autocast
        self.casts: dict[int, torch.Tensor] = {}
        self._recomputing: Optional[tuple[int, dict]] = None
        """(the module the mode was entered again for, the forward's cast cache) during a recompute."""
        self._thread = threading.get_ident()  # another thread's modules are not this trace's

    def reenter(self, module, args) -> None:
        """A module called where the mode is not active (a checkpointed block recomputed in backward):
        the mode again until it returns, with a cast cache of the recompute's own."""
        here = threading.get_ident() == self._thread
        if here and self._recomputing is None and self not in _function_modes():
            self._recomputing = (id(module), self.casts)
            self.casts = {}
            self.__enter__()

    def leave(self, module, args, output) -> None:
        if self._recomputing is not None and self._recomputing[0] == id(module):
            self.__exit__(None, None, None)
            self.casts.clear()  # the recompute's casts live on only where its backward keeps them
            self.casts = self._recomputing[1]
            self._recomputing = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.autocast is not None:
            if func in LOWER:
                args, kwargs = self._cast(args, kwargs, self.autocast)
            elif func in FP32:
                args, kwargs = self._cast(args, kwargs, torch.float32)
            elif func in FP32_OUTPUT and _low(args) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            elif func is F.cross_entropy and _low(args):
                return _cross_entropy(*args, **kwargs)
        if func is _SDPA:
            return cuda_attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(self, *args, **kwargs):
        """Attention reached through torch.nn.functional's attribute (from inside a composite function,
        where the mode does not see the call): the mode's casts, then CUDA's kernel."""
        if self.autocast is not None:
            args, kwargs = self._cast(args, kwargs, self.autocast)
        with torch._C.DisableTorchFunction():
            return cuda_attention(*args, **kwargs)

    def _cast(self, args, kwargs, dtype: torch.dtype):
        def cast(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
                return value
            if dtype != torch.float32 and value.dtype != torch.float32:
                return value  # autocast casts fp32 down and half precision up, nothing else
            if value.is_leaf and value.requires_grad and dtype != torch.float32:
                cached = self.casts.get(id(value))
                if cached is None:
                    cached = self.casts[id(value)] = value.to(dtype)
                return cached
            return value.to(dtype)

        return tree_map(cast, args), tree_map(cast, kwargs)


class Kernels:
    """What a `cuda_kernels` block reports, and the end of its autocast region."""

    def __init__(self, mode: _CudaMode):
        self._mode = mode
        self.choices = _CHOICES
        """Attention kernels taken, by name ({"flash": 24})."""

    def end_forward(self) -> None:
        """Autocast's cache of parameter casts ends with its region, the forward; the casts live on where
        backward keeps them."""
        self._mode.casts.clear()


@contextlib.contextmanager
def cuda_kernels(autocast: Optional[torch.dtype] = None) -> Iterator[Kernels]:
    """Within: meta tensors take CUDA's attention kernels and (with `autocast`) CUDA autocast's casts.
    torch.nn.functional's own callers (nn.MultiheadAttention) reach attention through the module's
    attribute, swapped for the block's duration; `cuda_attention` passes any device but meta to torch's
    own function, so other threads are unaffected."""
    _CHOICES.clear()
    mode = _CudaMode(autocast)
    F.scaled_dot_product_attention = mode.attention
    hooks = (
        torch.nn.modules.module.register_module_forward_pre_hook(mode.reenter),
        torch.nn.modules.module.register_module_forward_hook(mode.leave, always_call=True),
    )
    try:
        with mode:
            yield Kernels(mode)
    finally:
        for hook in hooks:
            hook.remove()
        F.scaled_dot_product_attention = _SDPA
        mode.casts.clear()


def _function_modes() -> list:
    """The torch function modes active in this thread (none while autograd runs a backward)."""
    return torch.overrides._get_current_function_mode_stack()
