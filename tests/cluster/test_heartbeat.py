"""Heartbeats and the router's pinned fingerprint against a real redis-server (RELIABILITY
rows 8 and 20): a worker started while Redis is down waits and joins when it comes back;
a mismatch found at a later beat that persists makes the worker give up (exit), one that
the router fixes within the grace does not; after Redis loses its data, a worker of
another model that registers first cannot hijack the cluster fingerprint; the internal
protocol version is part of the fingerprint.

Beats and refreshes are driven by hand (``Heartbeat.beat``, ``WorkerView.refresh``) with a
fake clock where the order of events is the point, so no test depends on thread timing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import redis

from cluster.heartbeat import Heartbeat
from cluster.registry import FingerprintMismatch, Registry
from cluster.view import WorkerView
from deploy.redis_server import RedisServer
from engine.kvcache.layout import PROTOCOL_VERSION
from tests.cluster.test_registry import LAYOUT, make_record
from tests.processes import wait_until

pytestmark = pytest.mark.timeout(30)

TTL_S, HEARTBEAT_S = 1.0, 0.1
FOREIGN = dataclasses.replace(LAYOUT, model_fingerprint="another-model")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry(redis_server: RedisServer) -> Iterator[Registry]:
    with Registry(redis_server.url, ttl_s=TTL_S, heartbeat_s=HEARTBEAT_S,
                  timeout_s=0.5) as reg:
        yield reg


def listed(registry: Registry) -> list[str]:
    return [r.worker_id for r in registry.list_workers()]


def test_a_worker_started_while_redis_is_down_waits_and_joins(
        redis_server: RedisServer, registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    # Defect: Heartbeat.start raised RegistryUnavailable, and the worker exited with a
    # traceback. Now it waits (saying what for) and joins once Redis answers.
    redis_server.stop()
    heartbeat = Heartbeat(registry, make_record("decode-late", "decode"))
    with caplog.at_level(logging.INFO, "cluster.heartbeat"):
        heartbeat.start()  # 1. does not raise
        try:
            assert not heartbeat.joined and heartbeat.alive
            wait_until(lambda: heartbeat.failures >= 3, 10.0, "beats retrying")
            assert not heartbeat.joined and "waiting for Redis" in caplog.text
            redis_server.restart()  # 2. Redis is back: the next beat joins
            wait_until(lambda: heartbeat.joined, 10.0, "the worker to join")
            assert listed(registry) == ["decode-late"] and registry.cluster_layout() == LAYOUT
            assert "joined the cluster after waiting" in caplog.text
            assert heartbeat.refused is None
        finally:
            heartbeat.stop()
    assert listed(registry) == []


def test_a_worker_starting_while_redis_refuses_writes_waits_and_joins(
        registry: Registry, raw_redis: redis.Redis) -> None:
    """Redis full (maxmemory under noeviction) or read-only (a failover) at the first
    registration: the worker waits to join, as while Redis is down (it raised, and the
    worker died after loading its model)."""
    before = raw_redis.config_get("maxmemory")["maxmemory"]
    raw_redis.set("ballast", "x" * 100_000)
    raw_redis.config_set("maxmemory", 1)
    heartbeat = Heartbeat(registry, make_record("decode-oom", "decode"))
    try:
        heartbeat.start()  # does not raise
        assert not heartbeat.joined and "maxmemory" in (heartbeat.last_error or "")
        raw_redis.config_set("maxmemory", before)
        wait_until(lambda: heartbeat.joined, 10.0, "the worker to join")
        assert listed(registry) == ["decode-oom"]
    finally:
        raw_redis.config_set("maxmemory", before)
        raw_redis.delete("ballast")
        heartbeat.stop()


def test_a_lasting_mismatch_at_a_later_beat_gives_up_a_passing_one_does_not(
        registry: Registry, raw_redis: redis.Redis) -> None:
    clock = FakeClock()
    refused: list[FingerprintMismatch] = []
    heartbeat = Heartbeat(registry, make_record("prefill-0"), on_mismatch=refused.append,
                          clock=clock)
    assert heartbeat.beat() and listed(registry) == ["prefill-0"]
    # 1. someone else's layout holds the fingerprint, for less than the grace (the TTL)
    raw_redis.set(registry.keys.fingerprint, _fingerprint_json(FOREIGN))
    assert not heartbeat.beat()
    clock.now += TTL_S * 0.9
    assert not heartbeat.beat() and refused == [] and heartbeat.refused is None
    # 2. it is fixed (the router re-asserts the pinned one): beats succeed again
    registry.assert_fingerprint(LAYOUT)
    assert heartbeat.beat() and refused == []
    # 3. again, and it lasts: the heartbeat gives up, naming the field
    raw_redis.set(registry.keys.fingerprint, _fingerprint_json(FOREIGN))
    clock.now += 10 * TTL_S
    assert not heartbeat.beat() and refused == []  # the grace starts at the first mismatch
    clock.now += TTL_S
    assert not heartbeat.beat()
    assert [e.field for e in refused] == ["model_fingerprint"]
    assert heartbeat.refused is refused[0]
    assert not heartbeat.beat() and len(refused) == 1  # stopped: no more beats, no more calls
    heartbeat.stop()


def test_the_router_pins_the_fingerprint_so_another_model_cannot_hijack_it(
        registry: Registry, raw_redis: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    # Defect: after Redis lost its data, whichever worker registered first claimed the
    # cluster fingerprint; a worker of another model doing so locked every good worker
    # out (their beats failed forever) and the router routed to nothing.
    clock = FakeClock()
    view = WorkerView(registry, model_fingerprint=LAYOUT.model_fingerprint)
    good_refused: list[FingerprintMismatch] = []
    foreign_refused: list[FingerprintMismatch] = []
    good = Heartbeat(registry, make_record("decode-good", "decode"),
                     on_mismatch=good_refused.append, clock=clock)
    foreign = Heartbeat(registry, make_record("decode-foreign", "decode", layout=FOREIGN),
                        on_mismatch=foreign_refused.append, clock=clock)
    # 1. the router pins the cluster's layout once it sees one of its model
    assert view.pinned is None
    assert good.beat()
    assert [w.worker_id for w in view.refresh().workers] == ["decode-good"]
    assert view.pinned == LAYOUT
    # 2. Redis loses everything; the foreign worker registers first and claims it
    raw_redis.flushall()
    assert foreign.beat() and registry.cluster_layout() == FOREIGN
    assert not good.beat()  # a mismatch, for now
    # 3. the router's next refresh re-asserts the pinned fingerprint
    with caplog.at_level(logging.WARNING, "cluster.view"):
        assert view.refresh().workers == ()
    assert registry.cluster_layout() == LAYOUT and view.reasserted == 1
    assert "re-asserted the cluster fingerprint" in caplog.text
    assert "model_fingerprint" in caplog.text
    # 4. the good worker registers again; the foreign one is refused and gives up
    assert good.beat()
    assert not foreign.beat()
    clock.now += TTL_S
    assert not foreign.beat()
    assert [e.field for e in foreign_refused] == ["model_fingerprint"] and good_refused == []
    foreign.stop()
    assert [w.worker_id for w in view.refresh().workers] == ["decode-good"]
    assert view.reasserted == 1  # nothing to fix any more
    # 5. a router of another model never pins (nor writes) this cluster's fingerprint
    other = WorkerView(registry, model_fingerprint="another-model")
    other.refresh()
    assert other.pinned is None and registry.cluster_layout() == LAYOUT
    good.stop()


def test_the_protocol_version_is_part_of_the_fingerprint(
        registry: Registry, raw_redis: redis.Redis) -> None:
    older = dataclasses.replace(LAYOUT, protocol_version=PROTOCOL_VERSION - 1)
    # 1. a worker of another protocol version is refused, naming the field
    registry.claim_fingerprint(LAYOUT)
    with pytest.raises(FingerprintMismatch) as info:
        Heartbeat(registry, make_record("prefill-old", layout=older)).start()
    assert info.value.field == "protocol_version"
    assert listed(registry) == []
    # 2. the protocol version is named first, before any other difference
    assert LAYOUT.diff(dataclasses.replace(older, block_size=32, dtype="float16")) \
        .startswith("protocol_version:")  # type: ignore[union-attr]
    # 3. a router does not pin a cluster fingerprint of another protocol version
    raw_redis.set(registry.keys.fingerprint, _fingerprint_json(older))
    view = WorkerView(registry, model_fingerprint=LAYOUT.model_fingerprint)
    view.refresh()
    assert view.pinned is None


def _fingerprint_json(layout: object) -> str:
    from cluster.records import layout_to_json

    return layout_to_json(layout)  # type: ignore[arg-type]


def test_a_beat_begun_before_a_role_switch_does_not_write_the_old_role_after_it(
        registry: Registry) -> None:
    """A periodic beat still reading the load when ``set_role`` comes must not register
    the role it replaced after the switch's own beat (routers would send it the wrong
    work until the next beat)."""
    import threading

    from cluster.records import WorkerLoad

    reading, go_on = threading.Event(), threading.Event()

    def load() -> WorkerLoad:
        if threading.current_thread().name == "slow-beat":
            reading.set()
            go_on.wait(5.0)
        return WorkerLoad(10, 12, 0, 0)

    heartbeat = Heartbeat(registry, make_record("switching-0", "decode"), load)
    slow = threading.Thread(target=heartbeat.beat, name="slow-beat")
    slow.start()
    assert reading.wait(5.0)
    switch = threading.Thread(target=heartbeat.set_role, args=("prefill",))
    switch.start()
    switch.join(0.3)  # with the beat holding the record's lock, the switch waits for it
    go_on.set()
    slow.join(5.0)
    switch.join(5.0)
    assert [r.role for r in registry.list_workers() if r.worker_id == "switching-0"] == \
        ["prefill"]
    heartbeat.stop()
