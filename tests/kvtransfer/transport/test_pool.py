"""The channel bound: LRU idle channels make room, borrowed ones are never closed."""

from __future__ import annotations

import threading
import time

import pytest

from kvtransfer.errors import ChannelError
from kvtransfer.transport.pool import ChannelPool


class FakeChannel:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed_reason: str | None = None
        self.graceful: bool | None = None
        self.last_used = time.monotonic()

    @property
    def is_open(self) -> bool:
        return self.closed_reason is None

    def close(self, reason: str = "closed", *, graceful: bool = False) -> None:
        if self.closed_reason is None:
            self.closed_reason, self.graceful = reason, graceful


def _open(pool: ChannelPool, key: str, *, idle: bool = True) -> FakeChannel:
    pool.reserve(1.0)
    channel = FakeChannel(key)
    pool.add(key, channel)  # type: ignore[arg-type]
    if idle:
        pool.checkin(channel)  # type: ignore[arg-type]
    return channel


def test_least_recently_used_idle_channel_makes_room() -> None:
    pool = ChannelPool(max_channels=2, idle_timeout_s=60)
    a, b = _open(pool, "a"), _open(pool, "b")
    assert pool.checkout("a") is a  # a is now the most recently used
    pool.checkin(a)  # type: ignore[arg-type]
    c = _open(pool, "c")
    assert b.closed_reason is not None and b.graceful and a.is_open and c.is_open
    assert len(pool) == 2 and pool.checkout("b") is None and pool.evicted == 1


def test_borrowed_channels_are_never_closed() -> None:
    pool = ChannelPool(max_channels=1, idle_timeout_s=60)
    a = _open(pool, "a", idle=False)
    with pytest.raises(ChannelError, match="in use"):
        pool.reserve(0.0, wait=False)
    start = time.monotonic()
    with pytest.raises(ChannelError):
        pool.reserve(0.2)
    assert time.monotonic() - start >= 0.2 and a.is_open


def test_a_returned_channel_wakes_a_waiting_reservation() -> None:
    pool = ChannelPool(max_channels=1, idle_timeout_s=60)
    a = _open(pool, "a", idle=False)
    threading.Timer(0.1, pool.checkin, args=(a,)).start()
    pool.reserve(5.0)  # succeeds once a is idle: a is closed to make room
    assert a.closed_reason is not None
    pool.cancel()
    assert len(pool) == 0


def test_broken_and_idle_channels_leave_the_pool() -> None:
    pool = ChannelPool(max_channels=4, idle_timeout_s=0.05)
    a, b = _open(pool, "a"), _open(pool, "b", idle=False)
    pool.discard(b, "broken")  # type: ignore[arg-type]
    assert b.closed_reason == "broken" and not b.graceful and len(pool) == 1
    time.sleep(0.1)
    pool.sweep_idle()
    assert a.closed_reason == "idle timeout" and len(pool) == 0


def test_close_all_is_graceful_only_for_idle_channels() -> None:
    pool = ChannelPool(max_channels=4, idle_timeout_s=60)
    idle, busy = _open(pool, "idle"), _open(pool, "busy", idle=False)
    pool.close_all()
    assert idle.graceful is True and busy.graceful is False and len(pool) == 0
