"""What a router shares with the other routers through Redis, besides the registry: the
workers' KV events feeding its KV index (``router.kv_feed``, kv-aware routing only), and
its load on each worker (``cluster.router_loads``), exchanged at every refresh of its view
so that its placement sees the whole cluster's traffic (``WorkerPool.cluster_inflight``).
"""

from __future__ import annotations

import asyncio
import logging

from cluster import pause_points
from cluster.registry import DEFAULT_TIMEOUT_S, Registry, RegistryError
from cluster.router_loads import DEFAULT_TTL_S, RouterLoads
from router.config import RouterConfig
from router.core import RouterCore
from router.kv_feed import KVFeed
from router.kv_index import KVIndex
from router.workers import HEALTH_TIMEOUT_S, WorkerPool

logger = logging.getLogger(__name__)


def load_ttl_s(refresh_interval_s: float, health_timeout_s: float = HEALTH_TIMEOUT_S,
               redis_timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """How long a router's shared load outlives its last write: two of its slowest refresh
    cycles (the interval, the registry read, a hung worker's health check, the exchange
    itself), so that one slow cycle never lets the key of a live router expire, which the
    other routers would read as its load gone to nothing."""
    cycle = refresh_interval_s + health_timeout_s + 2 * redis_timeout_s
    return max(DEFAULT_TTL_S, 2 * cycle)


class SharedState:
    """A router's KV feed and shared load view; ``start`` → ``refreshed`` … → ``stop``."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, core: RouterCore) -> None:
        d = config.discovery
        self._pool = pool
        self.loads = RouterLoads(d.redis_url, cluster=d.cluster, router_id=core.router_id,
                                 ttl_s=load_ttl_s(d.refresh_interval_s))
        self.kv_feed: KVFeed | None = None
        if config.handoff.prefill_routing == "kv-aware":  # on a Redis connection of its own
            core.kv_index = KVIndex()
            self.kv_feed = KVFeed(core.kv_index, Registry(d.redis_url, cluster=d.cluster),
                                  pool, core.metrics)
        self._feed_task: asyncio.Task[None] | None = None
        self._loads_failing = False
        self._exchange: asyncio.Future[dict[str, tuple[int, int]]] | None = None

    def start(self) -> None:
        if self.kv_feed is not None:
            self._feed_task = asyncio.create_task(self.kv_feed.run())

    async def refreshed(self) -> None:
        """After each refresh of the worker view: the live workers to the KV feed, this
        router's load out and the others' in (Redis down: its own figures alone)."""
        if self.kv_feed is not None:
            self.kv_feed.watch(self._pool.records())
        if pause_points.enabled():
            await pause_points.apause("router.load_exchange")
        self._exchange = asyncio.get_running_loop().run_in_executor(
            None, self.loads.exchange, self._pool.own_loads())
        try:
            others = await self._exchange
        except RegistryError as exc:
            if not self._loads_failing:
                logger.warning("routing on this router's own load alone: %s", exc)
            self._loads_failing, others = True, {}
        else:
            self._loads_failing = False
        self._pool.others_loads(others)

    def cancel(self) -> None:
        """Stop reading events (at the start of shutdown)."""
        if self._feed_task is not None:
            self._feed_task.cancel()

    async def stop(self) -> None:
        self.cancel()
        if self._feed_task is not None:
            await asyncio.gather(self._feed_task, return_exceptions=True)
        if self.kv_feed is not None:
            await self.kv_feed.stop()
        if self._exchange is not None:  # one still running would write after the close
            await asyncio.gather(self._exchange, return_exceptions=True)
        await asyncio.to_thread(self.loads.close)
