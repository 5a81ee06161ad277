"""``router.kv_feed``: the order of its first reads. A worker's snapshot is asked for only
once the stream's position is read: one taken before would miss the batches published
between it and that position, and an idle worker would stay wrong in the index. (Events
through real workers and Redis: tests/e2e/test_kv_routing.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

from router.kv_feed import KVFeed
from router.kv_index import KVIndex
from router.metrics import RouterMetrics
from tests.router.test_workers import make_record


class HeldTail:
    """A registry whose stream position comes only when ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def kv_events_tail(self) -> str:
        self.release.wait(5.0)
        return "0-0"

    def read_kv_events(self, after: str, *, block_ms: int, count: int) -> list[object]:
        time.sleep(block_ms / 1000)
        return []

    def close(self) -> None:
        pass


class Pool:
    """Records the workers whose snapshot was asked for (none answers)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def channel(self, worker_id: str) -> object:
        self.asked.append(worker_id)
        raise ConnectionError("no worker here")


def test_snapshots_are_asked_for_only_once_the_stream_position_is_read() -> None:
    async def go() -> None:
        registry, pool = HeldTail(), Pool()
        feed = KVFeed(KVIndex(), registry, pool, RouterMetrics())  # type: ignore[arg-type]
        task = asyncio.create_task(feed.run())
        try:
            feed.watch([make_record("w-1", "prefill", "127.0.0.1:1")])
            await asyncio.sleep(0.1)
            assert pool.asked == []  # the position is not read yet
            registry.release.set()
            for _ in range(100):
                if pool.asked:
                    break
                await asyncio.sleep(0.02)
            assert pool.asked == ["w-1"]
        finally:
            registry.release.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await feed.stop()

    asyncio.run(go())


class Backlog:
    """A stream whose every read is a full page: a router behind by more than it reads."""

    def kv_events_tail(self) -> str:
        return "0-0"

    def read_kv_events(self, after: str, *, block_ms: int, count: int) -> list[object]:
        time.sleep(0.005)
        return [(f"{after}-{i}", {}) for i in range(count)]  # (entries it cannot decode)

    def close(self) -> None:
        pass


def test_an_index_reading_a_backlog_is_not_trusted_past_its_staleness_bound() -> None:
    """Trust means the index is as current as the stream: reads of full pages (a backlog,
    after an outage or a stall) do not renew it, so the index ages out of trust until the
    feed catches up (every successful read renewed it, and a router falling behind was
    trusted for ever)."""
    now = [100.0]
    index = KVIndex(clock=lambda: now[0])

    async def go() -> None:
        feed = KVFeed(index, Backlog(), Pool(), RouterMetrics())  # type: ignore[arg-type]
        task = asyncio.create_task(feed.run())
        try:
            await asyncio.sleep(0.1)
            assert index.trusted()  # the position was read at the start
            now[0] += index.stale_after_s + 1
            await asyncio.sleep(0.1)  # more full pages read meanwhile
            assert not index.trusted()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await feed.stop()

    asyncio.run(go())
