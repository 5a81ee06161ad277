"""Attention over the paged KV cache with flash-attn's paged kernel (CUDA only).

flash-attn is an optional extra (``pip install pdserve[gpu]``); ``flash_available``
says whether it can be used for a given block size (its paged kernels need page sizes
that are a multiple of 256).
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import write_kv

FLASH_PAGE_MULTIPLE = 256


def flash_available(device: torch.device, block_size: int, dtype: torch.dtype) -> bool:
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and block_size % FLASH_PAGE_MULTIPLE == 0
        and importlib.util.find_spec("flash_attn") is not None
    )


class FlashAttentionBackend:
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_with_kvcache  # optional GPU dependency

        self._attend = flash_attn_with_kvcache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Same contract as ``TorchAttentionBackend.forward``."""
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._attend(
                q[:nd].unsqueeze(1), kv_cache[0], kv_cache[1],
                cache_seqlens=meta.decode_context_lens.to(torch.int32),
                block_table=meta.decode_block_tables.to(torch.int32),
                softmax_scale=scale, causal=True,
            ).squeeze(1)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.num_query_tokens)
            seqlens = torch.tensor([span.context_len], dtype=torch.int32, device=q.device)
            out[rows] = self._attend(
                q[rows].unsqueeze(0), kv_cache[0], kv_cache[1], cache_seqlens=seqlens,
                block_table=span.block_table.to(torch.int32).unsqueeze(0),
                softmax_scale=scale, causal=True,
            ).squeeze(0)
        return out
