"""Cluster state against a real redis-server: registration, TTL, heartbeats, restarts,
outages, fingerprints, passwords and malformed records (RELIABILITY rows 8, 19-21, 36)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from cluster.heartbeat import Heartbeat
from cluster.records import RecordFormatError, WorkerLoad, WorkerRecord
from cluster.registry import (
    FingerprintMismatch,
    Keys,
    Registry,
    RegistryAuthError,
    RegistryUnavailable,
    redact_url,
)
from cluster.view import WorkerView
from deploy.redis_server import RedisServer
from engine.kvcache.layout import PROTOCOL_VERSION, KVLayout
from tests.processes import wait_until

pytestmark = pytest.mark.timeout(30)

LAYOUT = KVLayout(model_fingerprint="tiny-test-model", dtype="float32", block_size=16,
                  hash_algorithm="xxh3_128", hash_seed=0, num_layers=2, num_kv_heads=2,
                  head_dim=8)
OTHER_LAYOUT = dataclasses.replace(LAYOUT, block_size=32)
TTL_S, HEARTBEAT_S = 1.0, 0.25


def make_record(worker_id: str = "prefill-0", role: str = "prefill", **overrides: Any
                ) -> WorkerRecord:
    values: dict[str, Any] = dict(
        worker_id=worker_id, role=role, grpc_address="127.0.0.1:5001",
        kv_address="127.0.0.1:5002", tensor_parallel_size=1, layout=LAYOUT,
        free_kv_blocks=10, total_kv_blocks=12, num_running=1, num_waiting=0,
        started_at=1_700_000_000.5)
    values.update(overrides)
    return WorkerRecord(**values)


@pytest.fixture
def registry(redis_server: RedisServer) -> Iterator[Registry]:
    with Registry(redis_server.url, ttl_s=TTL_S, heartbeat_s=HEARTBEAT_S) as reg:
        yield reg


def listed_ids(registry: Registry, role: str | None = None) -> list[str]:
    return [r.worker_id for r in registry.list_workers(role)]


# -- the record and the key schema (no Redis) -------------------------------------------------

def test_record_round_trips_through_versioned_json() -> None:
    record = make_record(layout=OTHER_LAYOUT, tensor_parallel_size=2,
                         metrics_address="127.0.0.1:9090")
    text = record.to_json()
    assert json.loads(text)["version"] == 3
    assert WorkerRecord.from_json(text) == record
    assert WorkerRecord.from_json(text.encode()) == record
    # a version-1 record (before metrics_address existed) still reads
    old = json.loads(text)
    old.update(version=1)
    del old["metrics_address"]
    assert WorkerRecord.from_json(json.dumps(old)).metrics_address == ""
    # a version-2 record (before the protocol version was recorded) reads as protocol 0,
    # so it differs from every current layout in that field
    old = json.loads(text)
    old.update(version=2)
    del old["layout"]["protocol_version"]
    older = WorkerRecord.from_json(json.dumps(old))
    assert older.layout.protocol_version == 0
    diff = record.layout.diff(older.layout)
    assert diff is not None and diff.startswith(f"protocol_version: {PROTOCOL_VERSION} != 0"), diff
    # a layout a protocol-6 process wrote (no kv_cache_dtype, nor a protocol-7 one's
    # kv_transfer_dtype) reads as "auto": the protocol version is what differs, and is named
    for version, missing in ((6, ("kv_cache_dtype", "kv_transfer_dtype")),
                             (7, ("kv_transfer_dtype",))):
        old = json.loads(text)
        for name in missing:
            del old["layout"][name]
        old["layout"]["protocol_version"] = version
        layout = WorkerRecord.from_json(json.dumps(old)).layout
        assert all(getattr(layout, name) == "auto" for name in missing)
        assert record.layout.diff(layout) == f"protocol_version: {PROTOCOL_VERSION} != {version}"
    assert record.with_load(WorkerLoad(1, 12, 5, 6)).load == WorkerLoad(1, 12, 5, 6)


def test_draining_is_written_only_when_set() -> None:
    # a reader without the field skips only the records of workers on their way out
    record = make_record()
    assert "draining" not in json.loads(record.to_json())
    assert WorkerRecord.from_json(record.to_json()).draining is False
    draining = dataclasses.replace(record, draining=True)
    assert json.loads(draining.to_json())["draining"] is True
    assert WorkerRecord.from_json(draining.to_json()) == draining


def _mutated(change: Any) -> str:
    body = json.loads(make_record().to_json())
    change(body)
    return json.dumps(body)


@pytest.mark.parametrize(("text", "message"), [
    (_mutated(lambda b: b.update(version=4)), "version 4"),
    (_mutated(lambda b: b["layout"].pop("protocol_version")), "missing"),
    (_mutated(lambda b: b.pop("version")), "version None"),
    (_mutated(lambda b: b.update(extra=1)), r"unknown \['extra'\]"),
    (_mutated(lambda b: b.pop("kv_address")), r"missing \['kv_address'\]"),
    (_mutated(lambda b: b.update(num_running=True)), "num_running must be int"),
    (_mutated(lambda b: b.update(role="router")), "role must be one of"),
    (_mutated(lambda b: b["layout"].update(dtype="int4")), "dtype must be one of"),
    (_mutated(lambda b: b["layout"].pop("head_dim")), "missing"),
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
])
def test_malformed_records_are_refused(text: str, message: str) -> None:
    with pytest.raises(RecordFormatError, match=message):
        WorkerRecord.from_json(text)


def test_key_schema_and_name_checks() -> None:
    keys = Keys()
    assert keys.worker("decode-1") == "pdserve:default:worker:decode-1"
    assert keys.fingerprint == "pdserve:default:fingerprint"
    assert Keys("blue").worker_pattern == "pdserve:blue:worker:*"
    with pytest.raises(ValueError, match="worker_id"):
        keys.worker("a*b")
    with pytest.raises(ValueError, match="grpc_address"):
        make_record(grpc_address="localhost")
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("redis://user:s3cret@h:1/0") == "redis://user:***@h:1/0"


def test_registered_workers_are_listed_by_role(registry: Registry) -> None:
    registry.register(make_record("prefill-0"))
    registry.register(make_record("decode-0", "decode", tensor_parallel_size=2))
    assert listed_ids(registry) == ["decode-0", "prefill-0"]
    assert listed_ids(registry, "decode") == ["decode-0"]
    [decode] = registry.list_workers("decode")
    assert decode == make_record("decode-0", "decode", tensor_parallel_size=2)
    registry.deregister("decode-0")
    assert listed_ids(registry) == ["prefill-0"]


def test_beats_keep_the_record_past_its_ttl_and_it_expires_when_they_stop(
        registry: Registry) -> None:
    heartbeat = Heartbeat(registry, make_record()).start()
    time.sleep(TTL_S * 1.5)  # several beats: each one re-SETs the TTL
    assert listed_ids(registry) == ["prefill-0"] and heartbeat.beats >= 3
    heartbeat.stop(deregister=False)  # a paused/hung worker: no delete, no more beats
    assert listed_ids(registry) == ["prefill-0"]
    wait_until(lambda: not listed_ids(registry), TTL_S + 2.0, "the record to expire")


def test_heartbeat_refreshes_the_load(registry: Registry) -> None:
    load = [WorkerLoad(10, 12, 1, 0)]
    with Heartbeat(registry, make_record(), lambda: load[0]):
        assert registry.list_workers()[0].load == WorkerLoad(10, 12, 1, 0)
        load[0] = WorkerLoad(2, 12, 7, 3)
        wait_until(lambda: registry.list_workers()[0].load == load[0], 3.0, "the new load")


def test_set_draining_writes_the_record_at_once_and_keeps_it(registry: Registry) -> None:
    with Heartbeat(registry, make_record(), lambda: WorkerLoad(10, 12, 1, 0)) as heartbeat:
        assert registry.list_workers()[0].draining is False
        assert heartbeat.set_draining()
        assert registry.list_workers()[0].draining is True  # no wait for the next beat
        assert heartbeat.beat() and registry.list_workers()[0].draining is True


def test_graceful_stop_deletes_the_key(registry: Registry, raw_redis: redis.Redis) -> None:
    heartbeat = Heartbeat(registry, make_record()).start()
    assert raw_redis.exists(registry.keys.worker("prefill-0"))
    heartbeat.stop()
    heartbeat.stop()  # idempotent
    assert not raw_redis.exists(registry.keys.worker("prefill-0"))
    assert not heartbeat.alive and raw_redis.exists(registry.keys.fingerprint)


def test_a_failing_load_callback_skips_the_beat_but_not_the_thread(registry: Registry) -> None:
    calls = [0]

    def flaky_load() -> WorkerLoad:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("engine busy")
        return WorkerLoad(10, 12, calls[0], 0)

    with Heartbeat(registry, make_record(), flaky_load) as heartbeat:
        wait_until(lambda: registry.list_workers()[0].num_running >= 3, 3.0, "a later beat")
        assert heartbeat.failures == 1 and heartbeat.alive and heartbeat.last_error is None


# -- Redis restarted or down (rows 19, 20) ------------------------------------------------------

def test_a_restarted_redis_is_refilled_within_one_beat(redis_server: RedisServer,
                                                       registry: Registry) -> None:
    with Heartbeat(registry, make_record()):
        redis_server.restart()
        assert registry.cluster_layout() is None and not listed_ids(registry)  # data lost
        restarted = time.monotonic()
        # One beat, plus slack for a loaded 2-core machine.
        wait_until(lambda: listed_ids(registry) == ["prefill-0"], HEARTBEAT_S + 1.0,
                   "re-registration within a beat")
        assert registry.cluster_layout() == LAYOUT
        print(f"refilled {time.monotonic() - restarted:.2f}s after the restart "
              f"(heartbeat {HEARTBEAT_S}s)")


def test_redis_down_keeps_beats_alive_and_the_view_last_known_good(
        redis_server: RedisServer, registry: Registry) -> None:
    now = [100.0]
    view = WorkerView(registry, clock=lambda: now[0])
    with Heartbeat(registry, make_record()) as heartbeat:
        assert [w.worker_id for w in view.refresh().workers] == ["prefill-0"]
        assert not view.stale and view.age_s() == 0.0

        redis_server.stop()  # 1. Redis down: beats fail, the view keeps what it knew
        now[0] += 30.0
        snapshot = view.refresh()
        assert snapshot.stale and [w.worker_id for w in snapshot.workers] == ["prefill-0"]
        assert "unreachable" in (snapshot.error or "") and view.age_s() == 30.0
        wait_until(lambda: heartbeat.failures >= 2, 10 * HEARTBEAT_S, "two failed beats")
        assert heartbeat.alive and "RegistryUnavailable" in (heartbeat.last_error or "")
        with pytest.raises(RegistryUnavailable, match="unreachable"):
            registry.list_workers()

        redis_server.restart()  # 2. back (empty): the next beat refills it
        wait_until(lambda: not view.refresh().stale and view.workers("prefill"),
                   HEARTBEAT_S + 2.0, "the view and the record back")
        assert heartbeat.last_error is None and view.age_s() == 0.0


def test_a_hung_redis_times_out_instead_of_blocking(redis_server: RedisServer) -> None:
    assert redis_server.pid is not None
    with Registry(redis_server.url, ttl_s=TTL_S, heartbeat_s=HEARTBEAT_S,
                  timeout_s=0.3) as registry:
        heartbeat = Heartbeat(registry, make_record()).start()
        view = WorkerView(registry)
        view.refresh()
        os.kill(redis_server.pid, signal.SIGSTOP)  # alive but silent
        try:
            snapshot = view.refresh()
            assert snapshot.stale and "prefill-0" in [w.worker_id for w in snapshot.workers]
            wait_until(lambda: heartbeat.failures >= 1, 3.0, "a failed beat")
            assert heartbeat.alive
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        wait_until(lambda: not view.refresh().stale, 3.0, "a fresh view")
        heartbeat.stop()
        assert not listed_ids(registry)


def test_a_view_of_an_unreachable_redis_is_empty_and_stale() -> None:
    with RedisServer() as server:
        url = server.url
    with Registry(url, timeout_s=0.5) as registry:  # nobody listens there any more
        view = WorkerView(registry)
        snapshot = view.refresh()
        assert snapshot.stale and snapshot.workers == () and math.isinf(view.age_s())
        with pytest.raises(RegistryUnavailable):
            registry.register(make_record())


# -- fingerprints (row 8) -----------------------------------------------------------------------

def test_a_differing_fingerprint_names_the_field_and_blocks_registration(
        registry: Registry, raw_redis: redis.Redis) -> None:
    registry.claim_fingerprint(LAYOUT)
    registry.claim_fingerprint(LAYOUT)  # the same layout again is fine
    with pytest.raises(FingerprintMismatch, match="block_size") as info:
        registry.claim_fingerprint(OTHER_LAYOUT)
    assert info.value.field == "block_size" and "32 != 16" in str(info.value)
    with pytest.raises(FingerprintMismatch, match="block_size"):
        Heartbeat(registry, make_record("decode-9", "decode", layout=OTHER_LAYOUT)).start()
    assert not raw_redis.exists(registry.keys.worker("decode-9"))
    registry.register(make_record("decode-1", "decode", tensor_parallel_size=4))  # TP may differ
    assert registry.cluster_layout() == LAYOUT


def test_listing_ignores_records_whose_layout_differs(
        registry: Registry, raw_redis: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    registry.register(make_record("prefill-0"))
    foreign = make_record("decode-0", "decode", layout=OTHER_LAYOUT)
    raw_redis.set(registry.keys.worker("decode-0"), foreign.to_json(), px=10_000)
    with caplog.at_level(logging.WARNING, "cluster.registry"):
        assert listed_ids(registry) == ["prefill-0"]
    assert "block_size: 32 != 16" in caplog.text


# -- bad records and credentials (row 36) -------------------------------------------------------

def test_malformed_records_are_skipped_and_logged_once(
        registry: Registry, raw_redis: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    registry.register(make_record("prefill-0"))
    raw_redis.set(registry.keys.worker("junk"), "{not json", px=10_000)
    raw_redis.set(registry.keys.worker("future"), _mutated(lambda b: b.update(version=9)))
    raw_redis.set(registry.keys.worker("imposter"), make_record("prefill-7").to_json())
    with caplog.at_level(logging.WARNING, "cluster.registry"):
        assert listed_ids(registry) == ["prefill-0"]
        assert listed_ids(registry) == ["prefill-0"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # once per key, not once per listing
    assert any("worker:junk" in line and "not JSON" in line for line in lines)
    assert any("worker:future" in line and "version 9" in line for line in lines)
    assert any("worker:imposter" in line and "prefill-7" in line for line in lines)


def test_a_password_protected_redis_works_and_a_wrong_password_is_clear() -> None:
    with RedisServer(password="s3cret") as server:
        with Registry(server.url) as registry:
            registry.register(make_record())
            assert listed_ids(registry) == ["prefill-0"]
        for url in (f"redis://:wrong-pw@127.0.0.1:{server.port}/0",
                    f"redis://127.0.0.1:{server.port}/0"):
            with Registry(url) as registry, pytest.raises(RegistryAuthError) as info:
                registry.ping()
            assert "refused authentication" in str(info.value)
            assert "wrong-pw" not in str(info.value) and "s3cret" not in str(info.value)
            assert not WorkerView(registry).refresh().workers  # the view still never raises


def test_the_fingerprint_is_reasserted_without_set_get(registry: Registry) -> None:
    """``SET … GET`` needs Redis 6.2: on an older external Redis every router refresh's
    re-assertion failed, and its worker view stayed frozen at the first one."""
    real = registry._client

    class Redis60:  # refuses SET's GET option, as Redis before 6.2 does
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def set(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("get"):
                raise redis.ResponseError("syntax error")
            return real.set(*args, **kwargs)

    registry._client = Redis60()  # type: ignore[assignment]
    try:
        assert registry.assert_fingerprint(LAYOUT) == "missing"
        assert registry.assert_fingerprint(LAYOUT) is None  # held ours since
    finally:
        registry._client = real


def test_routers_share_one_resume_key_across_a_redis_that_lost_its_data(
        redis_server: RedisServer) -> None:
    """Redis restarted without persistence: the routers' refresh writes back the key they
    seal with, so a router started then takes it up (it made another, and could not
    resume the others' streams: "the resume token does not seal this request")."""
    import asyncio
    from types import SimpleNamespace

    from router.resume import ResumeSeal
    from router.server import Router
    from tests.router.test_resume import REQUEST, _tokens

    def router(registry: Registry) -> SimpleNamespace:
        """What ``Router._share_resume_key`` reads of a router without a token."""
        return SimpleNamespace(core=SimpleNamespace(seal=ResumeSeal([registry.resume_key()])),
                               registry=registry, _own_resume_key=False)

    with Registry(redis_server.url, cluster="resume") as registry:
        a = router(registry)
        registry._client.flushall()  # Redis lost its data
        asyncio.run(Router._share_resume_key(a))  # type: ignore[arg-type]
        b = router(registry)  # a router started after
        assert b.core.seal.sealing_key == a.core.seal.sealing_key
        sent, token = _tokens(a.core.seal)[0]
        b.core.seal.check(REQUEST, token, sent)


def test_a_heartbeat_slower_than_the_routers_grace_is_refused() -> None:
    """Routers forget a worker missing from Redis after keep_missing_s (6 s): a worker
    beating every 8 s (with a 20 s TTL, accepted before) dropped out of every router at
    each Redis restart until it registered again."""
    from cluster.clock import MAX_HEARTBEAT_S
    from router.config import DiscoveryConfig

    with pytest.raises(ValueError, match="routers' grace"):
        Registry("redis://127.0.0.1:1", ttl_s=20.0, heartbeat_s=8.0)
    Registry("redis://127.0.0.1:1", ttl_s=20.0, heartbeat_s=MAX_HEARTBEAT_S).close()
    assert DiscoveryConfig("redis://x").keep_missing_s > MAX_HEARTBEAT_S
