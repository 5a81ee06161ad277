"""Copy KV between paged blocks and contiguous payload buffers.

A message carries, for layers ``[layer_start, layer_end)`` and a range of KV heads, the
request's first ``num_blocks`` blocks. Its *rows* are ``(layer, K|V, block)`` triples,
layer-major; one row is a block's ``[block_size, heads, wire_slot_width]`` slab (``head_dim``
values, or int8 values and their scale: ``KVLayout.wire_slot_width``)::

    row r -> plane = r // num_blocks   layer = layer_start + plane // 2   K|V = plane % 2
             block index = r % num_blocks   (block id = block_ids[block index])

A part carries rows ``[row_start, row_end)``; both sides cut the same rows into the same
contiguous segments, so the payload bytes are exactly
``kv_cache[layer, kv, block_ids[b], :, heads, :]`` for each row in order. Whole blocks
travel: the slots of the last block past ``num_tokens`` carry whatever the sender had
there (they are written on the receiver, which never reads them).

With ``kv_transfer_dtype="int8"`` over a cache that is not int8 (``KVLayout.wire_quantized``)
the sender quantises the rows it gathers into the int8 cache's slot format
(``engine.attention.kv_quant``) and the receiver dequantises them into its own cache:
``gather_for_wire`` / ``scatter_from_wire``; otherwise both copy the bytes as they lie (an
fp8 cache's as uint8: torch does not index-copy fp8 tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.attention.kv_quant import as_bytes, dequantize, quantize
from engine.kvcache.layout import KVLayout
from engine.tp.sharding import num_blocks_for


@dataclass(frozen=True)
class Segment:
    """Rows of one (layer, K|V) plane: block indices ``[block_start, block_end)``,
    at row offset ``offset`` within the part."""

    layer: int
    kv: int
    block_start: int
    block_end: int
    offset: int


def split_rows(num_rows: int, row_bytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """``[row_start, row_end)`` of each part: as many whole rows as fit ``part_bytes``
    (at least one)."""
    per_part = max(1, part_bytes // row_bytes)
    return [(start, min(start + per_part, num_rows)) for start in range(0, num_rows, per_part)]


def segments(layer_start: int, num_blocks: int, row_start: int, row_end: int) -> Iterator[Segment]:
    """The plane-contiguous pieces of rows ``[row_start, row_end)``."""
    row = row_start
    while row < row_end:
        plane, block = divmod(row, num_blocks)
        end = min(row_end, (plane + 1) * num_blocks)
        yield Segment(layer_start + plane // 2, plane % 2, block, block + end - row, row - row_start)
        row = end


def rows_view(payload: torch.Tensor, dtype: torch.dtype, num_rows: int, block_size: int,
              num_heads: int, head_dim: int) -> torch.Tensor:
    """``payload`` (uint8, contiguous) seen as ``[rows, block_size, heads, head_dim]``."""
    return payload.view(dtype).view(num_rows, block_size, num_heads, head_dim)


def gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: tuple[int, int],
           layer_start: int, num_blocks: int, rows: tuple[int, int], out: torch.Tensor) -> None:
    """Copy rows ``[rows[0], rows[1])`` of local heads ``[heads[0], heads[1])`` into ``out``
    (``[rows, block_size, heads, head_dim]``, contiguous)."""
    for seg in segments(layer_start, num_blocks, *rows):
        src = kv_cache[seg.layer, seg.kv, :, :, heads[0] : heads[1]]  # [blocks, bs, h, d]
        n = seg.block_end - seg.block_start
        torch.index_select(src, 0, block_ids[seg.block_start : seg.block_end],
                           out=out[seg.offset : seg.offset + n])


def scatter(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: tuple[int, int],
            layer_start: int, num_blocks: int, rows: tuple[int, int], src: torch.Tensor) -> None:
    """The inverse of ``gather``: write ``src``'s rows into the paged blocks.

    On CPU through numpy's fancy assignment, which copies rows about twice as fast as
    ``index_copy_`` (that one goes element by element)."""
    if kv_cache.device.type == "cpu" and kv_cache.dtype != torch.bfloat16:
        _scatter_numpy(kv_cache, block_ids, heads, layer_start, num_blocks, rows, src)
        return
    for seg in segments(layer_start, num_blocks, *rows):
        dst = kv_cache[seg.layer, seg.kv, :, :, heads[0] : heads[1]]
        n = seg.block_end - seg.block_start
        dst.index_copy_(0, block_ids[seg.block_start : seg.block_end],
                        src[seg.offset : seg.offset + n])


def _scatter_numpy(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: tuple[int, int],
                   layer_start: int, num_blocks: int, rows: tuple[int, int], src: torch.Tensor
                   ) -> None:
    cache, ids, rows_np = kv_cache.numpy(), block_ids.numpy(), src.numpy()
    for seg in segments(layer_start, num_blocks, *rows):
        n = seg.block_end - seg.block_start
        dst = cache[seg.layer, seg.kv, :, :, heads[0] : heads[1]]  # a view: writes land in cache
        dst[ids[seg.block_start : seg.block_end]] = rows_np[seg.offset : seg.offset + n]


def wire_rows(payload: torch.Tensor, layout: KVLayout, num_rows: int, num_heads: int
              ) -> torch.Tensor:
    """``payload`` seen as ``num_rows`` rows of ``num_heads`` heads in the wire's format."""
    return rows_view(payload, getattr(torch, layout.wire_dtype), num_rows, layout.block_size,
                     num_heads, layout.wire_slot_width)


def gather_for_wire(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: tuple[int, int],
                    layer_start: int, num_blocks: int, rows: tuple[int, int],
                    payload: torch.Tensor, layout: KVLayout) -> None:
    """``gather`` into ``payload`` (uint8, exactly the rows' bytes) in the wire's format:
    quantised when ``layout.wire_quantized``."""
    out = wire_rows(payload, layout, rows[1] - rows[0], heads[1] - heads[0])
    if not layout.wire_quantized:
        gather(as_bytes(kv_cache), block_ids, heads, layer_start, num_blocks, rows, out)
        return
    values = torch.empty(*out.shape[:-1], layout.head_dim, dtype=kv_cache.dtype,
                         device=kv_cache.device)
    gather(kv_cache, block_ids, heads, layer_start, num_blocks, rows, values)
    out.copy_(quantize(values))


def scatter_from_wire(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: tuple[int, int],
                      layer_start: int, num_blocks: int, rows: tuple[int, int],
                      payload: torch.Tensor, layout: KVLayout) -> None:
    """The inverse of ``gather_for_wire``: ``payload``'s rows into the paged blocks,
    dequantised into the cache's dtype when ``layout.wire_quantized``."""
    src = wire_rows(payload, layout, rows[1] - rows[0], heads[1] - heads[0])
    if layout.wire_quantized:
        src = dequantize(src, kv_cache.dtype)
    scatter(as_bytes(kv_cache), block_ids, heads, layer_start, num_blocks, rows, src)


def transfer_blocks(num_tokens: int, block_ids: list[int] | tuple[int, ...], block_size: int,
                    num_cache_blocks: int) -> list[int]:
    """The blocks a transfer of ``num_tokens`` tokens moves: the first
    ``ceil(num_tokens / block_size)`` of ``block_ids``; ``ValueError`` for too few tokens
    or blocks, or a block id outside the cache's ``num_cache_blocks``."""
    num_blocks = num_blocks_for(num_tokens, block_size)
    if num_tokens < 1 or len(block_ids) < num_blocks:
        raise ValueError(f"{num_tokens} tokens need {num_blocks} blocks, got {len(block_ids)}")
    ids = list(block_ids[:num_blocks])
    if min(ids) < 0 or max(ids) >= num_cache_blocks:
        raise ValueError(f"block ids out of range [0, {num_cache_blocks})")
    return ids
