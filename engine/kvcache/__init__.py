"""Torch-free paged KV-cache bookkeeping: block hashes, the block pool, block tables.

Everything here works on integer block ids and counts; the router imports the block
hash functions so that its affinity keys are exactly the keys workers cache.
"""

from engine.kvcache.block_hash import (
    HASH_ALGORITHM,
    BlockHash,
    compute_block_hashes,
    extend_block_hashes,
    hash_block_tokens,
    root_hash,
)
from engine.kvcache.block_manager import BlockManager, KVCacheUsage
from engine.kvcache.block_pool import BlockPool, KVCacheIntegrityError

__all__ = [
    "HASH_ALGORITHM",
    "BlockHash",
    "BlockManager",
    "BlockPool",
    "KVCacheIntegrityError",
    "KVCacheUsage",
    "compute_block_hashes",
    "extend_block_hashes",
    "hash_block_tokens",
    "root_hash",
]
