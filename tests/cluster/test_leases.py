"""Leases against a real redis-server, with a manual clock: the router's keeper writes,
renews, re-writes after a restart and deletes; the worker's watcher frees an attempt at
once when its lease lapsed in the Redis it was seen in, else only once it has been missing
for a full TTL while Redis answered."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence

import pytest
import redis

from cluster.clock import ManualClock
from cluster.leases import LeaseKeeper, LeaseKeys, LeaseStore, new_router_id
from deploy.redis_server import RedisServer
from tests.processes import wait_until
from worker.leases import LeaseBook, LeaseWatcher

pytestmark = pytest.mark.timeout(60)

TTL_S = 0.6


def test_keys_name_the_cluster_router_and_attempt() -> None:
    keys = LeaseKeys("c1")
    assert keys.lease("r1-7") == "pdserve:c1:lease:r1-7"
    assert keys.router_pattern("r1") == "pdserve:c1:lease:r1-*"
    with pytest.raises(ValueError):
        LeaseKeys("bad name*")
    assert new_router_id() != new_router_id()


def test_keeper_writes_renews_and_deletes(redis_server: RedisServer,
                                          raw_redis: redis.Redis) -> None:
    async def scenario() -> None:
        store = LeaseStore(redis_server.url, cluster="c")
        keeper = LeaseKeeper(store, TTL_S)
        keeper.start()
        # 1. an attempt's lease is written at once, naming its request and holders
        lease = keeper.open("r1-1", "client-id")
        keeper.hold(lease, "decode-0")
        assert lease.attempt_id == "r1-1" and lease.key == "pdserve:c:lease:r1-1"
        with pytest.raises(ValueError, match="live lease"):
            keeper.open("r1-1", "client-id")  # one lease per attempt
        await _until(lambda: raw_redis.exists(lease.key))
        keeper.hold(lease, "prefill-0")
        await _until(lambda: json.loads(raw_redis.get(lease.key) or "{}").get("holders")
                     == ["decode-0", "prefill-0"])
        assert json.loads(raw_redis.get(lease.key) or "{}")["client_request_id"] == "client-id"
        # 2. renewed: alive after several TTLs
        await asyncio.sleep(3 * TTL_S)
        assert raw_redis.exists(lease.key) and 0 < raw_redis.pttl(lease.key) <= 600
        # 3. Redis restarted empty: re-written within one renewal period (ttl / 3)
        redis_server.restart()
        await _until(lambda: _exists(redis_server, lease.key), timeout_s=5 * TTL_S)
        # 4. a second attempt of the same request has another id and key
        other = keeper.open("r1-2", "client-id")
        assert other.attempt_id != lease.attempt_id and other.key != lease.key
        # 5. ended: deleted; stop deletes what is left
        keeper.close(lease)
        await _until(lambda: not _exists(redis_server, lease.key))
        await keeper.stop()
        assert not _exists(redis_server, other.key)
        assert keeper.live() == [] and keeper.num_unwritten == 0
        store.close()

    asyncio.run(scenario())


class _SlowWriteStore(LeaseStore):
    """A store whose writes take ``delay_s`` after they were sent (a slow Redis reply)."""

    def __init__(self, url: str, delay_s: float) -> None:
        super().__init__(url, cluster="c")
        self.delay_s = delay_s
        self.writing = threading.Event()

    def write(self, values: dict[str, str], ttl_ms: int) -> None:
        if values:
            self.writing.set()
            time.sleep(self.delay_s)
        super().write(values, ttl_ms)


def test_keeper_stop_deletes_after_a_write_still_in_flight(redis_server: RedisServer,
                                                           raw_redis: redis.Redis) -> None:
    async def scenario() -> None:
        store = _SlowWriteStore(redis_server.url, delay_s=0.5)
        keeper = LeaseKeeper(store, 60.0)  # a key that outlived stop would live a minute
        keeper.start()
        lease = keeper.open("r3-1", "x")
        await asyncio.to_thread(store.writing.wait, 5.0)
        await keeper.stop()  # while the write is still on its way
        await asyncio.sleep(0.8)  # past the write's landing
        assert not raw_redis.exists(lease.key)
        store.close()

    asyncio.run(scenario())


def test_keeper_survives_redis_down(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        store = LeaseStore(redis_server.url, cluster="c", timeout_s=0.2)
        keeper = LeaseKeeper(store, TTL_S)
        keeper.start()
        port = redis_server.port
        redis_server.stop()
        lease = keeper.open("r2-1", "x")  # Redis down: the attempt goes on, the write waits
        await asyncio.sleep(TTL_S)
        assert keeper.num_failures >= 1 and keeper.num_unwritten == 1
        back = RedisServer(port=port, start_timeout_s=10.0).start()
        try:
            await _until(lambda: _exists(back, lease.key), timeout_s=10.0)
            assert keeper.num_unwritten == 0
            await keeper.stop()
            assert not _exists(back, lease.key)
        finally:
            back.stop()
        store.close()

    asyncio.run(scenario())


def _watching_r1(redis_server: RedisServer, raw_redis: redis.Redis
                 ) -> tuple[ManualClock, LeaseBook, list[str], LeaseWatcher]:
    """A watcher on a manual clock, watching attempt r-1 whose lease is in Redis."""
    clock = ManualClock()
    book, freed = LeaseBook(), list[str]()
    watcher = LeaseWatcher(LeaseStore(redis_server.url, timeout_s=0.3), book, freed.append,
                           clock)
    raw_redis.set("pdserve:default:lease:r:1", "{}")
    book.watch("r-1", "pdserve:default:lease:r:1", 10.0)
    return clock, book, freed, watcher


def test_watcher_frees_only_after_a_full_ttl_missing_with_redis_up(
        redis_server: RedisServer, raw_redis: redis.Redis) -> None:
    clock, book, freed, watcher = _watching_r1(redis_server, raw_redis)
    book.watch("r-2", "pdserve:default:lease:r:2", 10.0)  # never written: missing
    # 1. present: kept; missing: its clock starts, nothing freed before a full TTL
    assert watcher.check() == []
    clock.advance(9.9)
    assert watcher.check() == [] and len(book) == 2
    # 2. Redis unreachable: nothing is acted on, and the missing clock starts over
    port = redis_server.port
    redis_server.stop()
    clock.advance(5.0)
    assert watcher.check() == []
    back = RedisServer(port=port, start_timeout_s=10.0).start()  # back, empty
    try:
        assert watcher.check() == []  # seen missing again: a new TTL from now
        clock.advance(9.9)
        assert watcher.check() == [] and not freed
        # 3. a full TTL missing since Redis was last seen healthy: both freed, forgotten
        clock.advance(0.2)
        assert sorted(watcher.check()) == ["r-1", "r-2"]
        assert sorted(freed) == ["r-1", "r-2"] and len(book) == 0 and book.num_aborted == 2
    finally:
        back.stop()
        watcher.stop()


def test_watcher_keeps_a_lease_written_late_and_frees_it_once_it_lapses(
        redis_server: RedisServer, raw_redis: redis.Redis) -> None:
    clock = ManualClock()
    book, freed = LeaseBook(), list[str]()
    watcher = LeaseWatcher(LeaseStore(redis_server.url), book, freed.append, clock)
    book.watch("a", "pdserve:default:lease:r:9", 2.0)
    assert watcher.check() == []  # not written yet: a full TTL to appear
    clock.advance(1.5)
    raw_redis.set("pdserve:default:lease:r:9", "{}")  # the router's write landed
    assert watcher.check() == []
    clock.advance(0.1)
    # seen in this Redis, now gone from it (expired, or deleted): its router stopped
    # renewing it, so it is freed in the first check that misses it, no TTL's wait
    raw_redis.delete("pdserve:default:lease:r:9")
    assert watcher.check() == ["a"] and freed == ["a"] and len(book) == 0
    watcher.stop()


def test_watcher_never_frees_an_attempt_forgotten_while_it_looked(
        redis_server: RedisServer, raw_redis: redis.Redis) -> None:
    """Its call ended (a stream ended with a move offer) and its router closed the lease
    while the watcher's read of Redis was out: the lease is gone, but the attempt is no
    longer the watcher's to free (it would have freed a request parked for its move)."""
    clock, book, freed = ManualClock(), LeaseBook(), list[str]()

    class Racing(LeaseStore):
        def exist(self, keys: Sequence[str], *, writable: bool = False
                  ) -> tuple[str, list[bool]]:
            found = super().exist(keys, writable=writable)
            if not found[1][0]:
                book.forget("a")  # the call's end, between the snapshot and the answer
            return found

    watcher = LeaseWatcher(Racing(redis_server.url), book, freed.append, clock)
    book.watch("a", "pdserve:default:lease:r:8", 2.0)
    raw_redis.set("pdserve:default:lease:r:8", "{}")
    assert watcher.check() == []  # seen in this Redis
    raw_redis.delete("pdserve:default:lease:r:8")  # closed by its router
    assert watcher.check() == [] and freed == [] and book.num_aborted == 0
    watcher.stop()


def test_watcher_forgets_what_it_saw_when_redis_restarts(
        redis_server: RedisServer, raw_redis: redis.Redis) -> None:
    clock, book, freed, watcher = _watching_r1(redis_server, raw_redis)
    assert watcher.check() == []  # seen
    port = redis_server.port
    redis_server.stop()
    back = RedisServer(port=port, start_timeout_s=10.0).start()  # a new Redis, empty
    try:
        # missing from a Redis it was never seen in: the outage rule, a full TTL
        assert watcher.check() == []
        clock.advance(9.9)
        assert watcher.check() == [] and not freed
        with redis.Redis.from_url(back.url) as client:
            client.set("pdserve:default:lease:r:1", "{}")  # its router re-wrote it
        clock.advance(5.0)
        assert watcher.check() == [] and not freed
    finally:
        back.stop()
        watcher.stop()


def test_watcher_frees_nothing_while_redis_refuses_writes(
        redis_server: RedisServer, raw_redis: redis.Redis) -> None:
    """Out of memory (or a read-only replica), Redis answers reads but refuses the
    routers' renewals: a lease that lapses then is not a dead router's. That counts as an
    outage; once writes are taken again, the full TTL applies."""
    clock, book, freed, watcher = _watching_r1(redis_server, raw_redis)
    try:
        assert watcher.check() == []  # seen in this Redis
        raw_redis.config_set("maxmemory", 1)  # noeviction: writes refused, reads answered
        raw_redis.delete("pdserve:default:lease:r:1")  # lapsed: its router could not renew
        clock.advance(20.0)
        assert watcher.check() == [] and not freed
        raw_redis.config_set("maxmemory", 0)
        assert watcher.check() == []  # missing: a full TTL from now
        clock.advance(10.1)
        assert watcher.check() == ["r-1"]
        assert not raw_redis.keys("pdserve:default:lease_probe:*")  # the probe writes nothing
    finally:
        raw_redis.config_set("maxmemory", 0)
        watcher.stop()


class _StallingStore(LeaseStore):
    """A store whose next answer comes ``stall_s`` late (on the watcher's clock)."""

    def __init__(self, url: str, clock: ManualClock) -> None:
        super().__init__(url)
        self.clock, self.stall_s = clock, 0.0

    def exist(self, keys: Sequence[str], *, writable: bool = False) -> tuple[str, list[bool]]:
        answer = super().exist(keys, writable=writable)
        self.clock.advance(self.stall_s)
        self.stall_s = 0.0
        return answer


def test_watcher_forgets_what_it_saw_when_redis_stalls(
        redis_server: RedisServer, raw_redis: redis.Redis) -> None:
    clock = ManualClock()
    book, freed = LeaseBook(), list[str]()
    store = _StallingStore(redis_server.url, clock)
    watcher = LeaseWatcher(store, book, freed.append, clock)
    raw_redis.set("pdserve:default:lease:r:2", "{}")
    book.watch("b", "pdserve:default:lease:r:2", 4.0)
    assert watcher.check() == []  # seen
    # Redis answered late and without the lease: its router's renewals may have waited
    # as long, so what was seen before proves nothing; the full TTL applies
    raw_redis.delete("pdserve:default:lease:r:2")
    store.stall_s = 2.0
    assert watcher.check() == []
    clock.advance(3.9)
    assert watcher.check() == [] and not freed
    clock.advance(0.2)
    assert watcher.check() == ["b"]
    watcher.stop()


def test_watcher_warns_of_a_redis_that_evicts_keys(
        redis_server: RedisServer, raw_redis: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    raw_redis.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level(logging.WARNING, logger="worker.leases"):
            LeaseWatcher(LeaseStore(redis_server.url), LeaseBook(), print).start().stop()
        assert "maxmemory-policy allkeys-lru" in caplog.text
    finally:
        raw_redis.config_set("maxmemory-policy", "noeviction")


def test_book_forgets_attempts_the_worker_no_longer_holds(
        redis_server: RedisServer) -> None:
    clock = ManualClock()
    book, freed = LeaseBook(), list[str]()
    watcher = LeaseWatcher(LeaseStore(redis_server.url), book, freed.append, clock)
    book.watch("c", "pdserve:default:lease:r:3", 1.0)
    assert watcher.check() == []
    book.retain(set())  # the worker no longer holds it: forgotten, never freed
    clock.advance(5.0)
    assert watcher.check() == [] and not freed
    watcher.stop()


def test_book_watches_nothing_without_a_watcher() -> None:
    book = LeaseBook()
    book.watch("a", "k", 1.0)
    assert len(book) == 0


def _exists(server: RedisServer, key: str) -> bool:
    try:
        with redis.Redis.from_url(server.url, socket_timeout=1) as client:
            return bool(client.exists(key))
    except redis.RedisError:
        return False


async def _until(predicate: object, timeout_s: float = 5.0) -> None:
    await asyncio.to_thread(wait_until, predicate, timeout_s, "the lease state")  # type: ignore[arg-type]
