"""Shared factories for the KV-cache tests."""

from __future__ import annotations

from engine.kvcache import BlockManager, compute_block_hashes

BLOCK_SIZE = 4


def make_block_manager(
    num_blocks: int = 16, block_size: int = BLOCK_SIZE, *, enable_prefix_caching: bool = True
) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)


def make_prompt(num_tokens: int, start: int = 100) -> list[int]:
    """Distinct, recognisable token ids ``start, start + 1, ...``."""
    return list(range(start, start + num_tokens))


def prefill(manager: BlockManager, request_id: str, token_ids: list[int]) -> list[int]:
    """Allocate (reusing the cached prefix), 'compute', and key every full block.

    Returns the request's block table.
    """
    block_hashes = compute_block_hashes(token_ids, manager.block_size)
    cached = manager.get_cached_prefix(block_hashes)
    assert manager.allocate(request_id, len(token_ids), cached) is not None
    manager.cache_full_blocks(request_id, block_hashes)
    return manager.block_ids(request_id)
