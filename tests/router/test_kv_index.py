"""The router's KV index as a policy object: events, gaps, epochs, snapshots, LRU, trust."""

from __future__ import annotations

import pytest

from cluster.kv_events import EventBatch
from engine.kvcache.block_hash import compute_block_hashes
from engine.kvcache.events import REMOVED, STORED
from router.kv_index import (
    APPLIED,
    DUPLICATE,
    EPOCH_BACKWARDS,
    GAP,
    NEW_EPOCH,
    UNKNOWN_WORKER,
    WAITING,
    KVIndex,
)

HASHES = compute_block_hashes(list(range(16 * 6)), 16)  # 6 chained blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(worker: str, seq: int, hashes: list[bytes], epoch: int = 1) -> EventBatch:
    return EventBatch(worker, epoch, seq, tuple((STORED, h) for h in hashes))


def removed(worker: str, seq: int, hashes: list[bytes], epoch: int = 1) -> EventBatch:
    return EventBatch(worker, epoch, seq, tuple((REMOVED, h) for h in hashes))


def test_events_in_order_build_the_index_and_match_counts_leading_blocks() -> None:
    index = KVIndex()
    index.watch(["a", "b"])
    assert index.apply(stored("a", 1, HASHES[:4])) == NEW_EPOCH  # epoch start from empty
    assert index.apply(stored("b", 1, HASHES[:2])) == NEW_EPOCH
    assert index.apply(stored("a", 2, HASHES[4:5])) == APPLIED
    assert index.match(HASHES, ["a", "b", "c"]) == {"a": 5, "b": 2, "c": 0}
    # a hole in the chain ends the match there, whatever follows
    assert index.apply(removed("a", 3, HASHES[1:2])) == APPLIED
    assert index.match(HASHES, ["a", "b"]) == {"a": 1, "b": 2}
    assert index.num_blocks == 5  # 0, 1 (b), 2, 3, 4 (a)


def test_duplicate_gap_and_new_epoch() -> None:
    index = KVIndex()
    index.watch(["a"])
    index.apply(stored("a", 1, HASHES[:3]))
    assert index.apply(stored("a", 1, HASHES[:3])) == DUPLICATE
    # batch 2 is lost: batch 3 is a gap; the old blocks stay as a best guess meanwhile
    assert index.apply(stored("a", 3, HASHES[3:4])) == GAP
    assert index.wanted() == ["a"] and index.wanted() == []  # asked once
    assert index.match(HASHES, ["a"]) == {"a": 3}
    assert index.apply(stored("a", 4, HASHES[4:5])) == WAITING
    # the snapshot of batch 3 replaces what it knew; batch 4, which waited, goes on top
    assert index.load_snapshot("a", 1, 3, HASHES[:4]) == APPLIED
    assert index.match(HASHES, ["a"]) == {"a": 5}
    assert index.apply(stored("a", 5, HASHES[5:6])) == APPLIED
    # the worker restarted empty: everything of the old epoch goes at once
    assert index.apply(stored("a", 1, HASHES[:1], epoch=2)) == NEW_EPOCH
    assert index.match(HASHES, ["a"]) == {"a": 1} and index.num_blocks == 1
    # a new epoch seen mid-way (its first batch lost) forgets the old and waits
    assert index.apply(stored("a", 7, HASHES[:2], epoch=3)) == NEW_EPOCH
    assert index.match(HASHES, ["a"]) == {"a": 0} and index.wanted() == ["a"]


def test_bad_events_change_nothing() -> None:
    index = KVIndex()
    index.watch(["a"])
    index.apply(stored("a", 1, HASHES[:2], epoch=5))
    assert index.apply(stored("ghost", 1, HASHES[:2])) == UNKNOWN_WORKER
    assert index.apply(stored("a", 2, HASHES[:4], epoch=4)) == EPOCH_BACKWARDS
    assert index.load_snapshot("a", 4, 9, HASHES) == EPOCH_BACKWARDS
    assert index.match(HASHES, ["a", "ghost"]) == {"a": 2, "ghost": 0}


def test_a_snapshot_older_than_what_was_applied_is_ignored() -> None:
    index = KVIndex()
    index.watch(["a"])
    assert index.wanted() == ["a"]  # first seen: a snapshot is asked for
    index.apply(stored("a", 1, HASHES[:2]))
    index.apply(stored("a", 2, HASHES[2:3]))
    assert index.load_snapshot("a", 1, 1, HASHES[:2]) == DUPLICATE
    assert index.match(HASHES, ["a"]) == {"a": 3}
    # past a gap too: a snapshot asked for before it, older than what was applied, would
    # roll the worker back; it is refused, and one is asked for again
    assert index.apply(stored("a", 4, HASHES[4:5])) == GAP
    assert index.wanted() == ["a"]
    assert index.load_snapshot("a", 1, 1, HASHES[:2]) == DUPLICATE
    assert not index.is_synced("a") and index.wanted() == ["a"]
    assert index.load_snapshot("a", 1, 3, HASHES[:4]) == APPLIED  # then batch 4 follows on
    assert index.seq_of("a") == 4 and index.match(HASHES, ["a"]) == {"a": 5}


def test_watch_forgets_departed_workers_and_blocks_nobody_holds() -> None:
    index = KVIndex()
    index.watch(["a", "b"])
    index.apply(stored("a", 1, HASHES[:3]))
    index.apply(stored("b", 1, HASHES[:1]))
    index.watch(["b"])
    assert index.num_blocks == 1 and index.num_blocks_of("a") == 0
    assert index.apply(stored("a", 2, HASHES[3:4])) == UNKNOWN_WORKER


def test_size_cap_drops_the_least_recently_used_blocks() -> None:
    """Of a chain stored or matched together, the later blocks go first: a chain whose
    first block went could match nothing while its other blocks took room."""
    index = KVIndex(max_blocks=4)
    index.watch(["a", "b"])
    index.apply(stored("a", 1, HASHES[:4]))
    index.apply(stored("a", 2, HASHES[4:5]))  # one past the cap: block 3 goes, not 0
    assert index.num_blocks == 4 and index.num_blocks_of("a") == 4
    assert index.match(HASHES, ["a"]) == {"a": 3}  # blocks 0-2 matched, 2 now the oldest
    other = compute_block_hashes(list(range(1000, 1032)), 16)
    index.apply(stored("b", 1, other))  # two newer blocks: block 4, then block 2 go
    assert index.match(HASHES, ["a"]) == {"a": 2}
    assert index.match(other, ["b"]) == {"b": 2}


def test_trust_needs_a_recent_read() -> None:
    clock = Clock()
    index = KVIndex(stale_after_s=10.0, clock=clock)
    assert not index.trusted()
    index.heard()
    assert index.trusted()
    clock.now += 10.5
    assert not index.trusted() and index.age_s() == pytest.approx(10.5)


def test_a_failed_snapshot_is_asked_again() -> None:
    index = KVIndex()
    index.watch(["a"])
    assert index.wanted() == ["a"]
    index.snapshot_failed("a")
    assert index.wanted() == ["a"]
    index.load_snapshot("a", 3, 0, [])
    assert index.is_synced("a") and index.wanted() == []


def test_a_restarted_worker_is_forgotten_and_wants_a_snapshot() -> None:
    index = KVIndex()
    index.watch(["a"])
    index.wanted()
    index.apply(stored("a", 1, HASHES[:3]))
    index.restarted("a")
    assert index.num_blocks == 0 and not index.is_synced("a") and index.wanted() == ["a"]


def test_after_a_snapshot_a_waiting_batch_past_a_gap_is_dropped_not_waited_for() -> None:
    index = KVIndex()
    index.watch(["a"])
    index.apply(stored("a", 1, HASHES[:1]))
    assert index.apply(stored("a", 9, HASHES[1:2])) == GAP  # a batch from nowhere
    assert index.wanted() == ["a"]
    index.load_snapshot("a", 1, 1, HASHES[:1])
    assert index.wanted() == [] and index.seq_of("a") == 1  # no endless resync
    assert index.apply(stored("a", 2, HASHES[1:2])) == APPLIED


def test_batches_kept_for_a_snapshot_are_bounded_by_their_operations_too() -> None:
    """A worker waiting for its snapshot keeps the batches that follow, at most 65,536
    block operations of them (a batch holds up to 4,096: 1,024 full ones were 4 million);
    the snapshot applies those kept, and a gap past the dropped ones asks again."""
    from router import kv_index as kv_index_module

    index = KVIndex()
    index.watch(["a"])
    index.wanted()  # asked for "a"'s snapshot
    big = compute_block_hashes(list(range(16 * 4096)), 16)  # 4,096 blocks
    for seq in range(2, 2 + 20):  # 20 x 4,096 ops: only 16 batches fit
        outcome = index.apply(EventBatch("a", 1, seq, tuple((STORED, h) for h in big)))
        assert outcome == (NEW_EPOCH if seq == 2 else WAITING)
    state = index._workers["a"]
    assert len(state.pending) == 16
    assert state.pending_ops == 16 * 4096 == kv_index_module.MAX_PENDING_OPS
    index.load_snapshot("a", 1, 1, [])
    assert state.pending_ops == 0 and index.seq_of("a") == 17  # those kept, in order
    assert index.apply(stored("a", 22, HASHES[:1])) == GAP  # the dropped ones: a gap
