"""The one injectable clock of the cluster's timers (leases, TTLs, heartbeats), torch-free.

Code that waits on or measures time takes a ``Clock`` (default ``SYSTEM_CLOCK``) instead
of calling ``time`` directly, so a test can drive it (``ManualClock``) and a lease, a TTL
or a heartbeat can be exercised without waiting for it in real time.

- ``monotonic()``: seconds on a clock that never goes back (durations, deadlines);
- ``time()``: seconds since the epoch (only for what is written down for other processes);
- ``sleep(seconds)``: blocks the calling thread; ``asleep(seconds)`` for an asyncio loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol

# the slowest heartbeat a worker may have: routers keep a worker missing from Redis a second
# longer (``router.config.DiscoveryConfig.keep_missing_s``), past a restart's re-registration
MAX_HEARTBEAT_S = 5.0


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    async def asleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock (``time.monotonic``, ``time.time``, ``time.sleep``, ``asyncio.sleep``)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    async def asleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


SYSTEM_CLOCK: Clock = SystemClock()


class ManualClock:
    """A clock that moves only when told (``advance``); for tests. ``sleep`` blocks until
    another thread advanced the clock past the wake-up time; ``asleep`` yields to the
    event loop until then."""

    def __init__(self, start: float = 1000.0, epoch: float = 1.7e9) -> None:
        self._now = start
        self._epoch_offset = epoch - start
        self._moved = threading.Condition()

    def monotonic(self) -> float:
        with self._moved:
            return self._now

    def time(self) -> float:
        return self.monotonic() + self._epoch_offset

    def advance(self, seconds: float) -> None:
        with self._moved:
            self._now += seconds
            self._moved.notify_all()

    def sleep(self, seconds: float) -> None:
        with self._moved:
            wake = self._now + seconds
            while self._now < wake:
                self._moved.wait(0.05)

    async def asleep(self, seconds: float) -> None:
        wake = self.monotonic() + seconds
        while self.monotonic() < wake:
            await asyncio.sleep(0.001)
