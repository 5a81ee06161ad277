"""``router.loop_lag``: a stall of the event loop shows up as a lag of about its length."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.loop_lag import LoopLagMonitor
from router.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(30)


def test_a_stalled_loop_is_measured() -> None:
    metrics = RouterMetrics()

    async def scenario() -> LoopLagMonitor:
        monitor = LoopLagMonitor(metrics.loop_lag, period_s=0.01)
        monitor.start()
        await asyncio.sleep(0.1)
        calm = monitor.worst_s
        time.sleep(0.3)  # work that holds the loop
        await asyncio.sleep(0.05)
        await monitor.stop()
        assert calm < 0.2
        return monitor

    monitor = asyncio.run(scenario())
    assert 0.25 <= monitor.worst_s < 1.0
    text = metrics.render()[0].decode()
    assert 'pdserve:router_event_loop_lag_seconds_bucket{le="0.5"}' in text
    count = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("pdserve:router_event_loop_lag_seconds_count"))
    assert count >= 5
