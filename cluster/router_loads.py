"""Each router's load on each worker, shared through Redis, so that every router bounds load
and predicts queues from the whole cluster's traffic, not its own share of it
(torch-free; the router's ``WorkerPool`` adds the other routers' figures to its own).

Key schema (beside ``cluster.registry``'s)::

    load:{router_id}  JSON ``{"v": 1, "workers": {worker_id: [requests, tokens]}}``: the
                      requests that router has in flight on each worker and the prompt
                      tokens it has them compute. ``SET … PX ttl`` at every refresh of the
                      router's view while it has anything in flight; deleted once it has
                      nothing (an idle cluster holds no such key), and gone ttl after a
                      router that died.
    load_routers      set of the router ids that wrote a ``load:`` key (a reader finds
                      the keys without a SCAN); every writer renews its ttl, and readers
                      remove the ids whose key is gone, so it empties (and vanishes) with
                      the keys.

A malformed record is skipped. Redis errors surface as ``RegistryUnavailable``; the router
then goes on with its own figures.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.records import check_name
from cluster.registry import DEFAULT_TIMEOUT_S, RegistryUnavailable

DEFAULT_TTL_S = 2.0
Load = tuple[int, int]
"""(requests in flight, prompt tokens to compute) of one router on one worker."""


class RouterLoads:
    """One router's side of the shared load view."""

    def __init__(self, redis_url: str, *, cluster: str, router_id: str,
                 ttl_s: float = DEFAULT_TTL_S, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        check_name("cluster", cluster)
        self._prefix = f"pdserve:{cluster}:load:"
        self._key = self._prefix + router_id
        self._router_id = router_id
        self._routers = f"pdserve:{cluster}:load_routers"
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._client = redis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), protocol=2, health_check_interval=0)
        self._written = False

    def exchange(self, own: Mapping[str, Load]) -> dict[str, Load]:
        """Write this router's ``own`` load (or delete its key when it has none) and read
        the other routers': their figures summed per worker, in one round trip."""
        try:
            pipe = self._client.pipeline(transaction=False)
            if own:
                record = {"v": 1, "workers": {w: list(load) for w, load in own.items()}}
                pipe.set(self._key, json.dumps(record), px=self._ttl_ms)
                pipe.sadd(self._routers, self._router_id)
                pipe.pexpire(self._routers, self._ttl_ms)
            elif self._written:
                pipe.delete(self._key)
                pipe.srem(self._routers, self._router_id)
            pipe.smembers(self._routers)
            members: Any = pipe.execute()[-1]
            self._written = bool(own)
            others = sorted(m.decode() for m in members if m.decode() != self._router_id)
            values: Any = self._client.mget([self._prefix + r for r in others]) if others else []
            gone = [r for r, raw in zip(others, values, strict=True) if raw is None]
            if gone:  # died (their keys expired) or just went idle
                self._client.srem(self._routers, *gone)
        except redis.RedisError as exc:
            raise RegistryUnavailable(f"Redis failed while sharing router loads: {exc}") \
                from exc
        total: dict[str, Load] = {}
        for raw in values:
            for worker_id, (requests, tokens) in _workers(raw).items():
                have = total.get(worker_id, (0, 0))
                total[worker_id] = (have[0] + requests, have[1] + tokens)
        return total

    def close(self) -> None:
        """Delete this router's key (best effort) and close the connection."""
        try:
            self._client.delete(self._key)
            self._client.srem(self._routers, self._router_id)
        except redis.RedisError:
            pass
        self._client.close()


def _workers(raw: bytes | str | None) -> dict[str, Load]:
    """A record's figures; ``{}`` for a missing or malformed one."""
    if raw is None:
        return {}
    try:
        record = json.loads(raw)
        workers = record["workers"] if record.get("v") == 1 else {}
        return {str(w): (int(n), int(t)) for w, (n, t) in workers.items()
                if int(n) >= 0 and int(t) >= 0}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}
