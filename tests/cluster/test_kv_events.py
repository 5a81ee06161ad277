"""KV events: the block pool's log, the stream entry format, and a worker's publisher
against a real Redis (the router's reading side)."""

from __future__ import annotations

import pytest

from cluster.kv_events import (
    BadEvent,
    EventBatch,
    decode,
    encode,
    pack_hashes,
    unpack_hashes,
)
from cluster.registry import Registry, RegistryUnavailable
from deploy.redis_server import RedisServer
from engine.kvcache.block_hash import compute_block_hashes
from engine.kvcache.block_manager import BlockManager
from engine.kvcache.events import REMOVED, STORED, KVEventLog
from worker.kv_events import MAX_OPS_PER_BATCH, KVEventPublisher

HASHES = compute_block_hashes(list(range(64)), 16)


def test_the_pool_logs_what_its_prefix_cache_gains_and_loses() -> None:
    manager = BlockManager(4, 16)
    manager.allocate("early", 32)
    manager.cache_full_blocks("early", HASHES[:2])  # held before the log is attached
    events = KVEventLog()
    manager.publish_events(events)
    assert events.drain() == [(STORED, HASHES[0]), (STORED, HASHES[1])]
    manager.free("early")
    manager.allocate("next", 64)  # takes every block: the two cached ones are evicted
    ops = events.drain()
    assert sorted(ops) == sorted([(REMOVED, HASHES[0]), (REMOVED, HASHES[1])])
    manager.free("next")
    manager.allocate("third", 16)
    manager.cache_full_blocks("third", HASHES[:1])
    manager.free("third")
    assert manager.reset_prefix_cache()
    assert events.drain() == [(STORED, HASHES[0]), (REMOVED, HASHES[0])]


def test_entries_round_trip_and_bad_ones_are_refused() -> None:
    batch = EventBatch("w-1", 7, 3, ((STORED, HASHES[0]), (REMOVED, HASHES[1])), 12.5)
    fields = {k.encode(): v for k, v in encode(batch).items()}
    assert decode(fields) == batch
    with pytest.raises(BadEvent) as bad:
        decode({**fields, b"o": fields[b"o"][:-1]})  # a hash one byte short
    assert bad.value.reason == "hash_length"
    with pytest.raises(BadEvent) as bad:
        decode({**fields, b"o": b"X" + fields[b"o"][1:]})
    assert bad.value.reason == "op"
    for field, value in ((b"e", b"zero"), (b"s", b"0"), (b"w", b"")):
        with pytest.raises(BadEvent) as bad:
            decode({**fields, field: value})
        assert bad.value.reason == "malformed"
    with pytest.raises(BadEvent):
        decode({b"w": b"w-1"})
    assert unpack_hashes(pack_hashes(HASHES)) == HASHES
    with pytest.raises(BadEvent):
        unpack_hashes(b"short")


def test_a_publisher_numbers_its_batches_and_its_snapshot_matches_them(
        redis_server: RedisServer) -> None:
    registry = Registry(redis_server.url, cluster="kvpub")
    reader = Registry(redis_server.url, cluster="kvpub")
    events = KVEventLog()
    publisher = KVEventPublisher(registry, "w-1", events)
    try:
        tail = reader.kv_events_tail()
        assert publisher.publish_once() == 1  # batch 1 announces the epoch, empty
        events.stored_all(HASHES[:3])
        assert publisher.publish_once() == 1
        events.removed(HASHES[2])
        assert publisher.publish_once() == 1
        assert publisher.publish_once() == 0  # nothing new: no batch
        entries = reader.read_kv_events(tail, block_ms=100, count=10)
        batches = [decode(fields) for _, fields in entries]
        assert [(b.worker_id, b.epoch, b.seq) for b in batches] == [
            ("w-1", publisher.epoch, seq) for seq in (1, 2, 3)]
        assert batches[0].ops == () and batches[2].ops == ((REMOVED, HASHES[2]),)
        snapshot = publisher.snapshot()
        assert (snapshot.epoch, snapshot.seq) == (publisher.epoch, 3)
        assert sorted(snapshot.block_hashes) == sorted(HASHES[:2])
    finally:
        publisher.stop()
        reader.close()


def test_a_batch_redis_does_not_take_is_dropped_and_leaves_a_gap() -> None:
    registry = Registry("redis://127.0.0.1:1", cluster="kvpub", timeout_s=0.2)
    events = KVEventLog()
    publisher = KVEventPublisher(registry, "w-1", events)
    events.stored(HASHES[0])
    assert publisher.publish_once() == 1
    assert (publisher.published, publisher.dropped) == (0, 1)
    assert publisher.snapshot().seq == 1  # the snapshot has it: a router resyncs to it
    publisher.stop()


def test_a_quiet_worker_sends_an_empty_batch_now_and_then(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch Redis took and lost (a restart, a failover) must show as a gap even from a
    worker whose cache stays unchanged after it: a quiet one keeps numbering batches."""
    from worker import kv_events

    registry = Registry(redis_server.url, cluster="kvquiet")
    publisher = KVEventPublisher(registry, "w-1", KVEventLog())
    try:
        assert publisher.publish_once() == 1  # batch 1
        assert publisher.publish_once() == 0  # nothing new, not quiet for long: none
        monkeypatch.setattr(kv_events, "KEEPALIVE_S", 0.0)
        assert publisher.publish_once() == 1 and publisher.snapshot().seq == 2
    finally:
        publisher.stop()


def test_while_redis_does_not_answer_the_log_goes_into_the_snapshot_in_one_try() -> None:
    """A slow or absent Redis: each period one (empty) batch is tried and everything the
    log held goes into the snapshot, which routers resynchronise to after the gap (the
    log grew faster than a failing try every period drained it, and its backlog flooded
    the stream when Redis came back)."""
    class Slow:
        tries = 0

        def publish_kv_events(self, fields: object, maxlen: int) -> None:
            self.tries += 1
            raise RegistryUnavailable("Redis does not answer")

        def close(self) -> None:
            pass

    registry, events = Slow(), KVEventLog()
    publisher = KVEventPublisher(registry, "w-1", events)  # type: ignore[arg-type]
    assert publisher.publish_once() == 1 and registry.tries == 1  # batch 1 fails: failing
    many = [bytes([i % 256, i // 256]) * 8 for i in range(3 * MAX_OPS_PER_BATCH + 1)]
    events.stored_all(many)
    assert publisher.publish_once() == 1 and registry.tries == 2
    assert len(events) == 0 and set(many) <= set(publisher.snapshot().block_hashes)


def test_while_batches_are_dropped_an_empty_one_goes_each_period_so_routers_see_the_gap(
        redis_server: RedisServer) -> None:
    """A worker whose cache stops changing during an outage still shows its gap once
    Redis answers: an empty batch goes every period until one gets through."""
    real = Registry(redis_server.url, cluster="kvgap")
    reader = Registry(redis_server.url, cluster="kvgap")

    class Outage:  # the publisher's registry: Redis refuses while ``down``
        down = True

        def publish_kv_events(self, fields: object, maxlen: int) -> None:
            if self.down:
                raise RegistryUnavailable("Redis is down")
            real.publish_kv_events(fields, maxlen)

        def close(self) -> None:
            real.close()

    registry = Outage()
    events = KVEventLog()
    publisher = KVEventPublisher(registry, "w-1", events)  # type: ignore[arg-type]
    try:
        tail = reader.kv_events_tail()
        events.stored(HASHES[0])
        assert publisher.publish_once() == 1  # batch 1, dropped
        assert publisher.publish_once() == 1  # nothing new, still down: an empty batch 2
        registry.down = False
        assert publisher.publish_once() == 1  # an empty batch 3 gets through
        assert publisher.publish_once() == 0  # through: nothing more to say
        batches = [decode(f) for _, f in reader.read_kv_events(tail, block_ms=100, count=10)]
        assert [(b.seq, b.ops) for b in batches] == [(3, ())]  # a router sees 1..2 missing
        assert (publisher.published, publisher.dropped) == (1, 2)
    finally:
        publisher.stop()
        reader.close()
