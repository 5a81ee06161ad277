"""The quantised KV caches: int8 (``CacheConfig.kv_cache_dtype="int8"``) and fp8
(``"fp8_e4m3"``, ``"fp8_e5m2"``).

**int8**: each token's K (and V) of
each KV head is stored as ``head_dim`` int8 values followed by their fp32 scale (the
largest magnitude ÷ 127, symmetric), in one slot of ``head_dim + 4`` bytes — where fp32
takes ``4 × head_dim``. The cache is then a uint8 tensor ``[layers, 2, blocks,
block_size, local KV heads, head_dim + 4]``: the scales live beside the values they
scale, so whatever copies whole slots (a block's KV for a transfer, re-sharded by heads)
carries them without knowing they are there, and a checksum over the bytes covers both.

A scale per token and head, not per block: a block fills one decode token at a time, so
a per-block scale would have to re-quantise what the block already holds whenever a new
token is larger; per token, nothing once written is touched again. Attention reads the
cache dequantised (``dequantize``), the step's own K/V included (written first); a
prefill chunk with nothing cached before it attends to its K/V quantised and back, the
values the cache holds, so a prompt's KV is the same however it was chunked.

**fp8**: a tensor of torch's fp8 dtype, shaped as a full-precision cache, one byte per
value and no scale (vLLM's default, a scale of 1): values round to the nearest fp8 number
and saturate at its largest (448 for e4m3, 57,344 for e5m2) rather than overflow. A quarter
of fp32's bytes exactly. Torch's CPU ops copy fp8 tensors but do not index-write them, so
writes go through the bytes (``as_bytes``).
"""

from __future__ import annotations

import torch

from engine.kernels.cpu import native
from engine.kvcache.layout import KV_SCALE_BYTES

SCALE_BYTES = KV_SCALE_BYTES  # one fp32 scale after each slot's int8 values
_LEVELS = 127.0


def slot_bytes(head_dim: int) -> int:
    """Bytes of one token's K (or V) of one KV head in the int8 cache."""
    return head_dim + SCALE_BYTES


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` is a quantised cache: int8 slots (values and a scale, as uint8)
    or fp8 values."""
    return kv_cache.dtype == torch.uint8 or kv_cache.dtype in FP8_DTYPES


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor seen as its bytes (uint8, the same shape), for the copies torch does
    not do on fp8; any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def quantize(x: torch.Tensor, cache_dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``x [..., head_dim]`` (any float dtype) as a ``cache_dtype`` cache holds it: fp8
    values (saturated at the format's largest), or int8 slots ``[..., head_dim + 4]``
    (uint8): round-to-nearest of ``x / scale``, ``scale = max |x| / 127`` over the last
    dim. The int8 slots from the compiled kernel where it takes ``x`` (fp32, contiguous,
    CPU), else ``quantize_torch``: the same bytes either way."""
    if cache_dtype in FP8_DTYPES:
        largest = torch.finfo(cache_dtype).max
        return x.clamp(-largest, largest).to(cache_dtype)
    kernels = native() if x.device.type == "cpu" else None
    if kernels is not None and (out := kernels.quantize_kv(x)) is not None:
        return out
    return quantize_torch(x)


def dequantize(slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fp8 values, or int8 slots ``[..., head_dim + 4]``, back to ``[..., head_dim]`` values
    of ``dtype``: int8 slots by the compiled kernel where it takes them (fp32 out,
    contiguous CPU slots), else ``dequantize_torch``: the same values either way."""
    if slots.dtype in FP8_DTYPES:
        return slots.to(dtype)
    kernels = native() if slots.device.type == "cpu" and dtype == torch.float32 else None
    if kernels is not None and (out := kernels.dequantize_kv(slots)) is not None:
        return out
    return dequantize_torch(slots, dtype)


def quantize_torch(x: torch.Tensor) -> torch.Tensor:
    """``quantize`` in torch ops (any device; the reference the compiled kernels match)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
    scale = scale / _LEVELS
    values = torch.round(x / scale).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    head_dim = x.shape[-1]
    out = torch.empty(*x.shape[:-1], slot_bytes(head_dim), dtype=torch.uint8, device=x.device)
    out[..., :head_dim] = values.view(torch.uint8)
    out[..., head_dim:] = scale.contiguous().view(torch.uint8)
    return out


def dequantize_torch(slots: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize`` in torch ops (any device)."""
    head_dim = slots.shape[-1] - SCALE_BYTES
    values = slots[..., :head_dim].view(torch.int8).to(torch.float32)
    scale = slots[..., head_dim:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)
