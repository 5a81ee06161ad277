"""The routers' shared load view against a real Redis: each router's figures reach the
others, an idle router holds no key, a dead one's expire, a malformed one is skipped."""

from __future__ import annotations

import time

import pytest
import redis

from cluster.registry import RegistryUnavailable
from cluster.router_loads import RouterLoads
from deploy.redis_server import RedisServer


def test_each_router_sees_the_others_load_summed(redis_server: RedisServer,
                                                 raw_redis: redis.Redis) -> None:
    a, b, c = (RouterLoads(redis_server.url, cluster="c1", router_id=r, ttl_s=0.5)
               for r in ("router-a", "router-b", "router-c"))
    try:
        assert a.exchange({"prefill-0": (2, 300)}) == {}
        assert b.exchange({"prefill-0": (1, 50), "decode-0": (3, 0)}) == {"prefill-0": (2, 300)}
        assert c.exchange({}) == {"prefill-0": (3, 350), "decode-0": (3, 0)}
        assert a.exchange({"prefill-0": (2, 300)}) == {"prefill-0": (1, 50), "decode-0": (3, 0)}
        # an idle router deletes its key: an idle cluster holds none
        b.exchange({})
        assert c.exchange({}) == {"prefill-0": (2, 300)}
        raw_redis.set("pdserve:c1:load:router-x", "{not json")
        raw_redis.set("pdserve:c1:load:router-y", '{"v": 1, "workers": {"w": [-1, 5]}}')
        raw_redis.sadd("pdserve:c1:load_routers", "router-x", "router-y")
        assert c.exchange({}) == {"prefill-0": (2, 300)}  # malformed ones are skipped
        raw_redis.delete("pdserve:c1:load:router-x", "pdserve:c1:load:router-y")
        time.sleep(0.7)  # router-a stopped writing (died): its figures expire
        assert c.exchange({}) == {}
        assert raw_redis.keys("pdserve:c1:load*") == []  # the set of writers emptied too
    finally:
        for loads in (a, b, c):
            loads.close()


def test_redis_down_is_unavailable() -> None:
    loads = RouterLoads("redis://127.0.0.1:1", cluster="c1", router_id="r", timeout_s=0.2)
    with pytest.raises(RegistryUnavailable):
        loads.exchange({"w": (1, 1)})
    loads.close()


def test_a_routers_load_outlives_its_slowest_refresh_cycle() -> None:
    """The key's TTL covers two refresh cycles at their slowest (the interval, a hung
    worker's health check, the registry read and the exchange), so a slow cycle never lets
    a live router's load vanish from the other routers' view."""
    from cluster.registry import DEFAULT_TIMEOUT_S
    from router.shared import load_ttl_s
    from router.workers import HEALTH_TIMEOUT_S

    slowest = 0.5 + HEALTH_TIMEOUT_S + 2 * DEFAULT_TIMEOUT_S
    assert load_ttl_s(0.5) == pytest.approx(2 * slowest) == pytest.approx(9.0)
    assert load_ttl_s(0.0, 0.0, 0.1) == 2.0  # never below the key's own default
