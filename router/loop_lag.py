"""How late the router's event loop runs: a task that asks to wake every ``period_s`` and
records how much later than asked it woke (``pdserve:router_event_loop_lag_seconds``).

Everything the router does for a request runs on that one loop, so a lag is added to every
request's latency at that moment; a long one (a big tokenisation or template on the loop,
a burst of thousands of calls) is a stall. ``worst_s`` is the largest seen so far.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

PERIOD_S = 0.05


class LoopLagMonitor:
    """Samples the running loop's lag into ``histogram`` until ``stop``."""

    def __init__(self, histogram: Histogram, period_s: float = PERIOD_S) -> None:
        self._histogram = histogram
        self._period_s = period_s
        self._task: asyncio.Task[None] | None = None
        self.worst_s = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self._period_s)
            lag = max(0.0, time.monotonic() - asked - self._period_s)
            self.worst_s = max(self.worst_s, lag)
            self._histogram.observe(lag)
