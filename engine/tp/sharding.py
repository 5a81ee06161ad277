"""Integer rules shared across the tree, torch-free: how tensor parallelism splits a
dimension or the KV heads, and how many blocks hold N tokens.

The model's tensor-parallel layers (``engine.models.layers``), the KV data plane's
re-sharding plan (``kvtransfer.plan``), the block manager and the router all use these,
so they always agree.
"""

from __future__ import annotations


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's equal share of ``total`` (which ``size`` divides)."""
    assert total % size == 0, f"{total} is not divisible by {size}"
    per = total // size
    return rank * per, (rank + 1) * per


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank ``rank`` of ``size`` holds: heads
    ``[i*H/t, (i+1)*H/t)`` when t <= H; when t > H the single head ``floor(i*H/t)``
    (each head replicated over t/H ranks)."""
    if size <= num_kv_heads:
        return shard_range(num_kv_heads, rank, size)
    head = rank * num_kv_heads // size
    return head, head + 1


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that hold ``num_tokens`` tokens (the last may be
    partly filled)."""
    return -(-num_tokens // block_size)
