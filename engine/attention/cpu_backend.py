"""Attention over the paged KV cache on the CPU with pdserve's compiled decode kernel.

Decode tokens go to ``engine.kernels.cpu``' paged decode attention, which reads each
sequence's keys and values in place in its blocks (the torch path first gathers them
into a dense copy, then runs SDPA over it), and the step's K/V go into their slots in
one compiled call; prefill chunks, and shapes the kernels do not take, use the torch
path (``TorchAttentionBackend``).
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, write_kv
from engine.kernels.cpu import NativeKernels


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if not self.kernels.write_kv(kv_cache, k, v, slot_mapping):
            write_kv(kv_cache, k, v, slot_mapping)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        if not self.kernels.supports_decode_attention(q, kv_cache):
            return super()._decode(q, kv_cache, meta, scale)
        return self.kernels.paged_decode_attention(
            q, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
