from __future__ import annotations

import pytest

from engine.kvcache import KVCacheIntegrityError, KVCacheUsage, compute_block_hashes
from tests.engine.kvcache.factories import make_block_manager, make_prompt, prefill


def test_allocate_grow_and_free() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    # 1. prompt of 5 tokens -> 2 blocks
    assert manager.allocate("a", 5) == [0, 1]
    # 2. decode to 8 tokens: still 2 blocks; to 9: a third
    assert manager.allocate("a", 8) == []
    assert manager.allocate("a", 9) == [2]
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.usage() == KVCacheUsage(total=8, free=5, cached=0, pinned=0, in_use=3)
    manager.check_integrity()
    # 3. free
    assert manager.free("a")
    assert not manager.has_request("a")
    assert manager.usage() == KVCacheUsage(total=8, free=8, cached=0, pinned=0, in_use=0)
    manager.check_integrity()


def test_num_blocks_needed() -> None:
    manager = make_block_manager(block_size=4)
    assert [manager.num_blocks_needed(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_failed_allocate_changes_nothing() -> None:
    manager = make_block_manager(num_blocks=4, block_size=4)
    assert manager.allocate("a", 12) == [0, 1, 2]
    before = manager.usage()
    assert manager.allocate("b", 8) is None
    assert not manager.has_request("b")
    assert manager.allocate("a", 20) is None
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.usage() == before
    manager.check_integrity()


def test_prefix_hit_reuses_the_same_blocks() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    prompt = make_prompt(12)
    # 1. A fills 3 blocks, keys them, frees them: they stay cached
    table_a = prefill(manager, "a", prompt)
    manager.free("a")
    assert manager.usage().cached == 3
    # 2. B with the same prompt hits all three blocks
    hashes = compute_block_hashes(prompt, 4)
    assert manager.get_cached_prefix(hashes) == table_a
    assert manager.allocate("b", 13, table_a) == [3]
    assert manager.block_ids("b") == [*table_a, 3]
    assert manager.usage() == KVCacheUsage(total=8, free=4, cached=0, pinned=0, in_use=4)
    manager.check_integrity()


def test_prefix_hit_stops_at_first_miss_and_is_shared() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    table_a = prefill(manager, "a", make_prompt(12))
    other = make_prompt(4) + make_prompt(8, start=500)  # same first block only
    assert manager.get_cached_prefix(compute_block_hashes(other, 4)) == table_a[:1]
    table_b = prefill(manager, "b", other)
    assert table_b[0] == table_a[0] and table_b[1:] == [3, 4]
    manager.check_integrity()
    manager.free("a")
    assert manager.usage().in_use == 3  # block shared with b stays in use
    manager.free("b")
    assert manager.usage() == KVCacheUsage(total=8, free=3, cached=5, pinned=0, in_use=0)
    manager.check_integrity()


def test_idle_cached_hits_are_not_counted_as_allocatable() -> None:
    manager = make_block_manager(num_blocks=4, block_size=4)
    table_a = prefill(manager, "a", make_prompt(8))
    manager.free("a")
    assert manager.num_free_blocks == 4
    # 2 hits + 3 new = 5 blocks > 4: refused, and the hits keep no reference
    assert manager.allocate("b", 20, table_a) is None
    assert manager.usage() == KVCacheUsage(total=4, free=2, cached=2, pinned=0, in_use=0)
    assert manager.allocate("b", 16, table_a) == [2, 3]
    manager.check_integrity()


def test_lru_evicts_oldest_freed_and_last_block_first() -> None:
    manager = make_block_manager(num_blocks=6, block_size=4)
    prefill(manager, "old", make_prompt(12, start=0))  # blocks 0, 1, 2
    prefill(manager, "new", make_prompt(12, start=50))  # blocks 3, 4, 5
    manager.free("old")
    manager.free("new")
    # Evicted order: old's tail first, then the rest of old, then new's tail.
    assert manager.allocate("x", 4) == [2]
    assert manager.allocate("y", 8) == [1, 0]
    assert manager.allocate("z", 4) == [5]
    # old is gone from the cache; new's first two blocks still hit.
    assert manager.get_cached_prefix(compute_block_hashes(make_prompt(12, start=0), 4)) == []
    assert manager.get_cached_prefix(compute_block_hashes(make_prompt(12, start=50), 4)) == [3, 4]
    manager.check_integrity()


def test_pin_moves_blocks_from_request_to_pin() -> None:
    manager = make_block_manager(num_blocks=4, block_size=4)
    table = prefill(manager, "p", make_prompt(8))
    # 1. pin: the request is gone, the pin holds its blocks
    manager.pin("p")
    assert not manager.has_request("p") and manager.is_pinned("p")
    assert manager.pinned_block_ids("p") == table
    assert not manager.free("p")
    assert manager.usage() == KVCacheUsage(total=4, free=2, cached=0, pinned=2, in_use=0)
    # 2. pinned blocks cannot be evicted
    assert manager.allocate("q", 12) is None
    manager.check_integrity()
    # 3. unpin exactly once; the blocks stay cached
    assert manager.unpin("p")
    assert not manager.unpin("p")
    assert manager.usage() == KVCacheUsage(total=4, free=2, cached=2, pinned=0, in_use=0)
    manager.check_integrity()
    # 4. like free, unpin queues the last block for eviction first
    assert manager.allocate("q", 12) == [2, 3, table[1]]


def test_pin_and_request_ids_are_exclusive() -> None:
    manager = make_block_manager()
    manager.allocate("p", 4)
    manager.pin("p")
    with pytest.raises(ValueError, match="pinned"):
        manager.allocate("p", 4)
    with pytest.raises(KeyError):
        manager.pin("unknown")


def test_free_and_unpin_of_unknown_ids_return_false() -> None:
    manager = make_block_manager()
    assert not manager.free("nope")
    assert not manager.unpin("nope")
    manager.allocate("a", 4)
    assert manager.free("a")
    assert not manager.free("a")
    manager.check_integrity()


def test_duplicate_content_keeps_the_first_cached_block() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    prompt = make_prompt(8)
    hashes = compute_block_hashes(prompt, 4)
    # Both computed without a hit (e.g. scheduled in the same step).
    manager.allocate("a", 8)
    manager.allocate("b", 8)
    manager.cache_full_blocks("a", hashes)
    manager.cache_full_blocks("b", hashes)
    assert manager.get_cached_prefix(hashes) == manager.block_ids("a")
    manager.check_integrity()
    manager.free("a")
    manager.free("b")
    assert manager.usage() == KVCacheUsage(total=8, free=6, cached=2, pinned=0, in_use=0)
    manager.check_integrity()


def test_cache_full_blocks_is_incremental() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    tokens = make_prompt(6)
    manager.allocate("a", len(tokens))
    manager.cache_full_blocks("a", compute_block_hashes(tokens, 4))
    tokens += make_prompt(3, start=900)  # decode completes block 1
    manager.allocate("a", len(tokens))
    hashes = compute_block_hashes(tokens, 4)
    manager.cache_full_blocks("a", hashes)
    assert manager.get_cached_prefix(hashes) == manager.block_ids("a")[:2]
    with pytest.raises(ValueError, match="holding"):
        manager.cache_full_blocks("a", hashes * 2)


def test_prefix_caching_disabled() -> None:
    manager = make_block_manager(enable_prefix_caching=False)
    prompt = make_prompt(8)
    hashes = compute_block_hashes(prompt, 4)
    manager.allocate("a", 8)
    manager.cache_full_blocks("a", hashes)
    manager.free("a")
    assert manager.get_cached_prefix(hashes) == []
    assert manager.usage().cached == 0


def test_allocate_argument_errors_change_nothing() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    table = prefill(manager, "a", make_prompt(8))
    with pytest.raises(ValueError, match="later allocate"):
        manager.allocate("a", 12, table)
    with pytest.raises(ValueError, match="exceed"):
        manager.allocate("b", 4, table)
    with pytest.raises(ValueError, match="repeat"):
        manager.allocate("b", 8, [table[0], table[0]])
    with pytest.raises(ValueError, match="not in the prefix cache"):
        manager.allocate("b", 8, [7])
    with pytest.raises(ValueError, match=">= 0"):
        manager.allocate("b", -1)
    assert not manager.has_request("b")
    manager.check_integrity()


def test_reset_prefix_cache() -> None:
    manager = make_block_manager(num_blocks=8, block_size=4)
    prefill(manager, "a", make_prompt(8))
    prefill(manager, "b", make_prompt(8, start=300))
    manager.free("a")
    assert not manager.reset_prefix_cache()  # b still holds keyed blocks
    assert manager.usage().cached == 0
    manager.free("b")
    assert manager.reset_prefix_cache()
    assert manager.usage() == KVCacheUsage(total=8, free=8, cached=0, pinned=0, in_use=0)
    manager.check_integrity()


def test_check_integrity_catches_a_lost_reference() -> None:
    manager = make_block_manager()
    manager.allocate("a", 8)
    manager._pool.touch([0])  # a reference no table accounts for
    with pytest.raises(KVCacheIntegrityError, match="held by"):
        manager.check_integrity()


@pytest.mark.parametrize("past_the_end", [False, True])
def test_check_integrity_catches_a_table_holding_a_block_outside_the_pool(
        past_the_end: bool) -> None:
    manager = make_block_manager()
    manager.allocate("a", 8)
    block_id = manager.num_blocks if past_the_end else -1
    manager._tables["a"] += (block_id,)  # a corrupted table (tuples: replaced, not grown)
    with pytest.raises(KVCacheIntegrityError, match=f"holds block {block_id}, outside"):
        manager.check_integrity()


def test_cached_prefix_stops_at_first_miss_even_if_later_keys_are_cached() -> None:
    manager = make_block_manager(num_blocks=5, block_size=4)
    prompt = make_prompt(12)
    hashes = compute_block_hashes(prompt, 4)
    # 1. A keys block 0 with h0; B computes the whole prompt concurrently: its copy of
    #    block 0 is a duplicate (unkeyed), its blocks 3, 4 get h1, h2.
    prefill(manager, "a", prompt[:4] + make_prompt(4, start=900))
    assert manager.allocate("b", 12) == [2, 3, 4]
    manager.cache_full_blocks("b", hashes)
    # 2. Free A, then B: the LRU is [1, 0 (h0), 4, 3, 2]; C evicts 1 and h0.
    manager.free("a")
    manager.free("b")
    assert manager.allocate("c", 8) == [1, 0]
    # 3. h1 and h2 are still cached, but the prefix is broken at h0.
    assert manager.get_cached_prefix(hashes[1:]) == [3, 4]
    assert manager.get_cached_prefix(hashes) == []
    manager.check_integrity()
