"""Chained block hashes: the one prefix-cache key shared by the router and every worker.

A block is ``block_size`` consecutive token ids. Block ``i`` of a sequence is keyed by

    h_i = XXH3-128(h_{i-1} | num_tokens | token_ids_i | extra_keys)     h_{-1} = root_hash(seed)

so a key names the whole prefix up to and including its block, not only the block's own
tokens. The byte encoding is fixed (little-endian int64 token ids, length-prefixed extra
keys), so the same tokens give the same key in every process and on every machine;
Python's ``hash()`` is never used. Only full blocks have a key: a trailing partial block
can still change, so it cannot be shared.

Torch-free: the router imports this module.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

BlockHash = bytes
"""A 16-byte XXH3-128 digest naming a full block and everything before it."""

HASH_ALGORITHM = "xxh3_128"
"""Part of the cluster fingerprint: workers with another algorithm must not join."""

ExtraKey = int | str
ExtraKeys = tuple[ExtraKey, ...]

_ROOT_DOMAIN = b"pdserve/kvcache/root/v1"
_BLOCK_DOMAIN = b"pdserve/kvcache/block/v1"
_INT_TAG = b"i"
_STR_TAG = b"s"


LOSSY_WIRE_SALT = "kv-wire:int8"
"""The salt of a sequence whose KV crossed the wire quantised
(``CacheConfig.kv_transfer_dtype="int8"``): its blocks are not the ones computed here in
full precision, so they never share a key with them."""


def root_hash(seed: int = 0, salt: str = "") -> BlockHash:
    """The parent hash of a sequence's first block.

    Different seeds give disjoint key spaces (a cluster can isolate itself by seed).
    ``seed`` may be any Python int, negative or wider than 64 bits. A non-empty ``salt``
    gives a key space of its own within the seed's: blocks whose KV was made otherwise
    (``LOSSY_WIRE_SALT``) are kept apart from the plain ones, and from their descendants.
    """
    data = _ROOT_DOMAIN + _encode_int(seed)
    if salt:
        data += _encode_extra_keys((salt,))
    return xxhash.xxh3_128_digest(data)


def hash_block_tokens(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    """``H(parent, token_ids, extra_keys)``: the key of one block given its parent's key.

    ``parent`` is ``root_hash(seed)`` for the first block. Token ids must fit in int64
    (``OverflowError`` otherwise). ``extra_keys`` carries what else decides the block's
    KV (adapter name, multimodal content hash, ...); ints and strs only (``TypeError``
    for anything else, bools included).
    """
    if len(parent) != 16:
        raise ValueError(f"parent hash must be 16 bytes ({HASH_ALGORITHM}), got {len(parent)}")
    hasher = xxhash.xxh3_128(_BLOCK_DOMAIN)
    hasher.update(parent)
    hasher.update(struct.pack("<Q", len(token_ids)))
    hasher.update(_encode_token_ids(token_ids))
    hasher.update(_encode_extra_keys(extra_keys))
    return hasher.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: int = 0,
    extra_keys: ExtraKeys = (),
    salt: str = "",
) -> list[BlockHash]:
    """Keys of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` of them).

    The trailing partial block, if any, has no key. ``extra_keys`` applies to every block;
    ``salt`` is the root's (``root_hash``).
    """
    block_hashes: list[BlockHash] = []
    extend_block_hashes(block_hashes, token_ids, block_size, seed=seed, extra_keys=extra_keys,
                        salt=salt)
    return block_hashes


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: int = 0,
    extra_keys: ExtraKeys = (),
    salt: str = "",
) -> list[BlockHash]:
    """Append to ``block_hashes`` the keys of blocks of ``token_ids`` completed since.

    ``block_hashes`` must hold the keys of the first ``len(block_hashes)`` blocks of this
    same sequence (with the same ``seed``, ``extra_keys`` and ``salt``); ``token_ids`` is the whole
    sequence so far, e.g. prompt + generated tokens during decode. Mutates
    ``block_hashes`` in place and returns only the newly appended keys.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    num_known = len(block_hashes)
    if num_known > num_full_blocks:
        raise ValueError(
            f"{num_known} block hashes given but {len(token_ids)} tokens make only "
            f"{num_full_blocks} full blocks of {block_size}"
        )
    parent = block_hashes[-1] if block_hashes else root_hash(seed, salt)
    new_hashes: list[BlockHash] = []
    # token range of block i: [i * block_size, (i + 1) * block_size)
    for block_index in range(num_known, num_full_blocks):
        start = block_index * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        new_hashes.append(parent)
    block_hashes.extend(new_hashes)
    return new_hashes


def _encode_token_ids(token_ids: Sequence[int]) -> bytes:
    encoded = array("q", token_ids)  # int64; raises OverflowError past int64
    if sys.byteorder != "little":
        encoded.byteswap()
    return encoded.tobytes()


def _encode_int(value: int) -> bytes:
    """Length-prefixed two's-complement little-endian encoding of any Python int."""
    num_bytes = value.bit_length() // 8 + 1
    return struct.pack("<I", num_bytes) + value.to_bytes(num_bytes, "little", signed=True)


def _encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """Count, then per key a type tag and a length-prefixed payload: no two key tuples
    encode to the same bytes (``(1,)`` vs ``("1",)``, ``("ab",)`` vs ``("a", "b")``)."""
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, int | str):
            raise TypeError(f"extra keys must be int or str, got {type(key).__name__}")
        if isinstance(key, int):
            parts.append(_INT_TAG + _encode_int(key))
        else:
            payload = key.encode("utf-8")
            parts.append(_STR_TAG + struct.pack("<I", len(payload)) + payload)
    return b"".join(parts)
