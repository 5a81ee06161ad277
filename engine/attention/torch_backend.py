"""Attention over the paged KV cache with torch SDPA (CPU, and CUDA without flash-attn).

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V),
or an int8 cache's ``[..., head_dim + 4]`` uint8 slots, or fp8 values
(``engine.attention.kv_quant``): written quantised, read dequantised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.kv_quant import as_bytes, dequantize, is_quantized, quantize
from engine.attention.metadata import AttentionMetadata, PrefillSpan


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V ``[T, Hk, D]`` into their slots (quantised, into an int8 or
    fp8 cache)."""
    if is_quantized(kv_cache):
        k, v = as_bytes(quantize(k, kv_cache.dtype)), as_bytes(quantize(v, kv_cache.dtype))
    cache = as_bytes(kv_cache)
    num_kv_heads, width = cache.shape[-2:]
    cache[0].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, k)
    cache[1].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, v)


def _read(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache slots as values of ``dtype`` (dequantised from an int8 or fp8 cache)."""
    return dequantize(cached, dtype) if is_quantized(cached) else cached


def _as_cached(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """K or V rows ``[T, Hk, D]`` as a quantised ``kv_cache`` holds them once written
    (quantised and back: the same values its reads give); as they are otherwise."""
    if not is_quantized(kv_cache):
        return x
    return _read(quantize(x.contiguous(), kv_cache.dtype), x.dtype)


def fresh_runs(spans: list[PrefillSpan]) -> list[list[PrefillSpan]]:
    """``spans`` in order, grouped into runs attention can batch: consecutive chunks of
    equal length with nothing cached before them (``context_len == num_query_tokens``),
    each starting where the previous one ends. Any other span is a run of its own."""
    runs: list[list[PrefillSpan]] = []
    for span in spans:
        last = runs[-1][-1] if runs else None
        if (last is not None and _fresh(span) and _fresh(last)
                and span.num_query_tokens == last.num_query_tokens
                and span.query_start == last.query_start + last.num_query_tokens):
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def _fresh(span: PrefillSpan) -> bool:
    return span.context_len == span.num_query_tokens


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` → output ``[T, Hq, D]``; writes k/v to the cache."""
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        nd = meta.num_decode_tokens
        if nd == q.shape[0]:  # a decode-only step: no output rows to assemble
            return self._decode(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
        for run in fresh_runs(meta.prefills):
            n = run[0].num_query_tokens
            rows = slice(run[0].query_start, run[0].query_start + len(run) * n)
            if not _fresh(run[0]):  # it reads its K/V from the cache
                out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, run[0], scale)
                continue
            # nothing cached before it: it attends to its K/V as the cache holds them, as
            # later chunks and decode steps do, so a prompt's KV does not depend on how it
            # was cut into chunks or on what the prefix cache held
            keys, values = _as_cached(k[rows], kv_cache), _as_cached(v[rows], kv_cache)
            if len(run) == 1:
                out[rows] = self._prefill(q[rows], keys, values, kv_cache, run[0], scale)
            else:
                out[rows] = self._prefill_fresh(q[rows], keys, values, len(run), scale)
        return out

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter the step's K/V into their slots (``write_kv``)."""
        write_kv(kv_cache, k, v, slot_mapping)

    @staticmethod
    def _prefill_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                       scale: float) -> torch.Tensor:
        """Causal attention of ``num_seqs`` equal-length chunks with nothing cached before
        them, adjacent in the batch, in one call: q ``[S * n, Hq, D]`` → ``[S * n, Hq, D]``."""
        n = q.shape[0] // num_seqs

        def by_seq(x: torch.Tensor) -> torch.Tensor:  # [S * n, H, D] -> [S, H, n, D]
            return x.reshape(num_seqs, n, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(by_seq(q), by_seq(k), by_seq(v), is_causal=True,
                                             scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(num_seqs * n, q.shape[1], q.shape[2])

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """One query token per sequence, q ``[B, Hq, D]`` → ``[B, Hq, D]``, over the keys of
        its blocks. The query heads that share a KV head go in as that head's query rows
        (``[B, Hk, Hq / Hk, D]``): SDPA then walks each sequence's K/V once per KV head
        rather than once per query head."""
        num_seqs, num_q_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        flat_tables = meta.decode_block_tables.reshape(-1)
        length = meta.decode_block_tables.shape[1] * block_size
        # [B * blocks, block_size, Hk, D] -> [B, L, Hk, D], used as [B, Hk, L, D]
        keys = _read(kv_cache[0].index_select(0, flat_tables), q.dtype).view(
            num_seqs, length, num_kv_heads, head_dim)
        values = _read(kv_cache[1].index_select(0, flat_tables), q.dtype).view(
            num_seqs, length, num_kv_heads, head_dim)
        group = num_q_heads // num_kv_heads
        out = F.scaled_dot_product_attention(
            q.view(num_seqs, num_kv_heads, group, head_dim),
            keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=meta.decode_key_bias(length, q.dtype).view(num_seqs, 1, 1, length),
            scale=scale,
        )
        # reshape: CUDA's memory-efficient kernel returns [B, Hk, g, D] with Hk and g not
        # adjacent in memory
        return out.reshape(num_seqs, num_q_heads, head_dim)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 span: PrefillSpan, scale: float) -> torch.Tensor:
        n, ctx = span.num_query_tokens, span.context_len
        if ctx == n:  # nothing cached before this chunk: attend over the chunk itself
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
            mask = None
        else:
            block_size = kv_cache.shape[2]
            blocks = span.block_table[: -(-ctx // block_size)]
            keys = _read(kv_cache[0][blocks].flatten(0, 1)[:ctx], q.dtype).transpose(0, 1)
            values = _read(kv_cache[1][blocks].flatten(0, 1)[:ctx], q.dtype).transpose(0, 1)
            # query i sits at position ctx - n + i and sees keys 0..that position
            q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)
