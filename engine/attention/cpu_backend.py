"""Attention over the paged KV cache on the CPU with pdserve's compiled decode kernel.

Decode tokens go to ``engine.cpu_kernels``' paged decode attention, which reads each
sequence's keys and values in place in its blocks (the torch path first gathers them
into a dense copy, then runs SDPA over it); prefill chunks, and decode shapes the
kernel does not take, use the torch path (``TorchAttentionBackend``).
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.cpu_kernels import NativeKernels


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if not self.kernels.supports_decode_attention(q, kv_cache):
            return super()._decode(q, kv_cache, meta, scale)
        return self.kernels.paged_decode_attention(
            q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
