"""Attention backends over the paged KV cache, behind one interface:
``backend.forward(q, k, v, kv_cache, metadata, scale) -> out``."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.flash_backend import FlashAttentionBackend, flash_available
from engine.attention.metadata import (
    AttentionMetadata,
    ForwardContext,
    PrefillSpan,
    forward_context,
    get_forward_context,
)
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu import native


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor: ...


def select_backend(device: torch.device, block_size: int, dtype: torch.dtype,
                   kv_cache_dtype: str = "auto") -> AttentionBackend:
    """flash-attn on CUDA (fp16/bf16) when importable and the block size fits its kernels
    (not over an int8 or fp8 KV cache, which it cannot read); on the CPU in fp32, pdserve's
    compiled decode kernel where it could be built (``PDSERVE_CPU_KERNELS=0`` switches it
    off); else torch SDPA."""
    if kv_cache_dtype == "auto" and flash_available(device, block_size, dtype):
        return FlashAttentionBackend()
    if device.type == "cpu" and dtype == torch.float32:
        kernels = native()
        if kernels is not None:
            return CpuAttentionBackend(kernels)
    return TorchAttentionBackend()


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "PrefillSpan",
    "forward_context",
    "get_forward_context",
    "select_backend",
]
