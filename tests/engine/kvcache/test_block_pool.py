from __future__ import annotations

import pytest

from engine.kvcache import BlockPool, KVCacheIntegrityError, root_hash

H1, H2 = b"1" * 16, b"2" * 16


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free == 1 and pool.num_in_use == 3
    pool.check_integrity()


def test_release_returns_blocks_to_lru_tail_in_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.release([2, 0, 3, 1])
    assert pool.allocate(4) == [2, 0, 3, 1]


def test_release_without_reference_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(ValueError, match="no reference"):
        pool.release([0, 0])
    assert pool.ref_count(0) == 1
    pool.check_integrity()


def test_touch_takes_cached_block_out_of_free_queue_keeping_hash() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1) or []
    assert pool.register_hash(block, H1)
    pool.release([block])
    assert pool.num_cached == 1 and pool.num_free == 2
    pool.touch([block])
    assert pool.lookup(H1) == block and pool.num_free == 1 and pool.num_cached == 0
    pool.check_integrity()


def test_allocating_a_cached_block_evicts_it() -> None:
    pool = BlockPool(1)
    pool.allocate(1)
    pool.register_hash(0, H1)
    pool.release([0])
    assert pool.allocate(1) == [0]
    assert pool.lookup(H1) is None and pool.block_hash(0) is None
    pool.check_integrity()


def test_register_hash_rules() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    assert pool.register_hash(0, H1)
    assert pool.register_hash(0, H1)  # idempotent
    assert not pool.register_hash(1, H1)  # duplicate content: first copy stays
    assert pool.lookup(H1) == 0 and pool.block_hash(1) is None
    with pytest.raises(ValueError, match="different hash"):
        pool.register_hash(0, H2)
    with pytest.raises(ValueError, match="unheld"):
        pool.register_hash(2, H2)
    pool.check_integrity()


def test_pin_keeps_block_out_of_free_queue_until_unpinned() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    pool.pin([0])
    pool.release([0])
    assert pool.num_pinned == 1 and pool.num_free == 1 and pool.num_in_use == 0
    assert pool.allocate(2) is None
    pool.unpin([0])
    assert pool.num_pinned == 0 and pool.num_free == 2
    with pytest.raises(ValueError, match="no pin"):
        pool.unpin([0])
    pool.check_integrity()


def test_reset_prefix_cache_drops_idle_hashes_only() -> None:
    pool = BlockPool(2)
    pool.allocate(2)
    pool.register_hash(0, H1)
    pool.register_hash(1, H2)
    pool.release([0])
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(H1) is None and pool.lookup(H2) == 1
    assert pool.num_cached == 0 and pool.num_hashed == 1
    pool.check_integrity()


def test_out_of_range_ids_are_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="outside"):
        pool.touch([2])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._ref_counts[0] = 0  # a lost reference: block 0 idle but not in the free queue
    with pytest.raises(KVCacheIntegrityError, match="free queue"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool.allocate(1)
    pool._hash_to_block[root_hash()] = 0  # map entry without the per-block hash
    with pytest.raises(KVCacheIntegrityError, match="hash map"):
        pool.check_integrity()

    pool = BlockPool(3)
    pool._num_pinned = 1  # tracked counter drifted
    with pytest.raises(KVCacheIntegrityError, match="tracked"):
        pool.check_integrity()
