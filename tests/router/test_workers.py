"""router.workers.WorkerPool against a real redis-server and real in-process gRPC servers
(RELIABILITY rows 19-22).

The "workers" here are stand-ins: grpc.aio servers on 127.0.0.1 (port 0) that serve only
``grpc.health.v1`` plus one test method that hangs until cancelled (for ``watched``). The
pool talks to a worker only through its health service and the channel it hands out, so
nothing else of a worker is needed. Records are written with ``Registry.register`` as a
worker's heartbeat would. Time is a fake clock wherever the pool measures it; only Redis
TTL expiry waits for real. Every test body runs under ``asyncio.run`` with an overall
``wait_for`` bound, every RPC has a timeout, and every server is stopped in ``finally``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from cluster.internal.v1 import worker_pb2 as wpb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.records import WorkerRecord
from cluster.registry import Registry
from deploy.redis_server import RedisServer
from engine.kvcache.layout import KVLayout
from router.workers import HUNG_AFTER, WorkerPool

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny-test-model"
LAYOUT = KVLayout(model_fingerprint=MODEL, dtype="float32", block_size=16,
                  hash_algorithm="xxh3_128", hash_seed=0, num_layers=2, num_kv_heads=2,
                  head_dim=8)
FOREIGN_LAYOUT = dataclasses.replace(LAYOUT, model_fingerprint="some-other-model")
KEEP_MISSING_S, SUSPECT_S = 6.0, 5.0
HEALTH_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 20.0  # bound on every test body
WAIT_S = 5.0  # bound on waiting for one asynchronous effect
HANG_METHOD = "/pdserve.test.Hang/Sleep"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LOGGER = "router.workers"


# -- fakes -----------------------------------------------------------------------------------

class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeWorker:
    """A stand-in worker: a grpc.aio server with grpc.health.v1 and one hanging method."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    address: str
    hanging: asyncio.Event = field(default_factory=asyncio.Event)  # a Sleep call arrived
    hang_cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # ... and was cancelled

    def hang_health_checks(self) -> None:
        """From now on health checks get no answer (as from a SIGSTOPped worker)."""
        self.health.hung = True  # type: ignore[attr-defined]

    async def set_serving(self, serving: bool) -> None:
        await self.health.set("", SERVING if serving else NOT_SERVING)


class _HangableHealth(health_aio.HealthServicer):
    hung = False

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 -- gRPC name
        if self.hung:
            await asyncio.sleep(3600)  # the caller's deadline ends it
        return await super().Check(request, context)


@asynccontextmanager
async def fake_worker(serving: bool = True) -> AsyncIterator[FakeWorker]:
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
    health = _HangableHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    worker = FakeWorker(server, health, f"127.0.0.1:{port}")

    async def sleep(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        worker.hanging.set()
        try:
            await asyncio.sleep(60)  # the client's timeout ends it long before
        except asyncio.CancelledError:
            worker.hang_cancelled.set()
            raise
        return b""

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "pdserve.test.Hang", {"Sleep": grpc.unary_unary_rpc_method_handler(sleep)}),))
    await worker.set_serving(serving)
    await server.start()
    try:
        yield worker
    finally:
        await server.stop(None)


def silent_listener() -> socket.socket:
    """A port that accepts TCP connections (kernel backlog) but never speaks HTTP/2."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def make_record(worker_id: str, role: str, address: str, **overrides: Any) -> WorkerRecord:
    values: dict[str, Any] = dict(
        worker_id=worker_id, role=role, grpc_address=address, kv_address="127.0.0.1:5002",
        tensor_parallel_size=1, layout=LAYOUT, free_kv_blocks=10, total_kv_blocks=12,
        num_running=0, num_waiting=0, started_at=1_700_000_000.0)
    values.update(overrides)
    return WorkerRecord(**values)


def ids(records: list[WorkerRecord]) -> list[str]:
    return [r.worker_id for r in records]


def run(body: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(body, BODY_TIMEOUT_S))


def new_pool(registry: Registry, clock: FakeClock, **kwargs: Any) -> WorkerPool:
    return WorkerPool(registry, MODEL, keep_missing_s=KEEP_MISSING_S, suspect_s=SUSPECT_S,
                      health_timeout_s=HEALTH_TIMEOUT_S, clock=clock, **kwargs)


async def health_check(stub: health_pb2_grpc.HealthStub) -> None:
    await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)


async def refresh_fresh(pool: WorkerPool) -> None:
    """Refresh until one read of Redis succeeds (the first after a restart may not)."""
    for _ in range(5):
        await pool.refresh()
        if pool.view_age_s == 0.0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("Redis never answered the refresh")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer(start_timeout_s=10.0) as server:
        yield server


@pytest.fixture
def registry(redis_server: RedisServer) -> Iterator[Registry]:
    with Registry(redis_server.url, timeout_s=0.5) as reg:
        yield reg


# -- routable workers ------------------------------------------------------------------------

def test_registered_serving_workers_are_routable_by_role(registry: Registry) -> None:
    async def body() -> None:
        async with fake_worker() as p0, fake_worker() as d0, fake_worker() as d1:
            registry.register(make_record("prefill-0", "prefill", p0.address))
            registry.register(make_record("decode-1", "decode", d1.address, total_kv_blocks=64,
                                          free_kv_blocks=64, tensor_parallel_size=2))
            registry.register(make_record("decode-0", "decode", d0.address, total_kv_blocks=40))
            pool = new_pool(registry, FakeClock())
            try:
                # Nothing is known before the first refresh.
                assert pool.routable("prefill") == [] and pool.layout() is None
                assert pool.max_decode_blocks() == 0 and pool.num_channels == 0
                await pool.refresh()
                assert ids(pool.routable("prefill")) == ["prefill-0"]
                assert ids(pool.routable("decode")) == ["decode-0", "decode-1"]  # sorted by id
                [decode1] = [r for r in pool.routable("decode") if r.worker_id == "decode-1"]
                assert decode1.tensor_parallel_size == 2 and decode1.grpc_address == d1.address
                assert pool.layout() == LAYOUT
                assert pool.max_decode_blocks() == 64
                assert pool.num_channels == 3 and pool.view_age_s == 0.0
                # The stubs use channels that reach those workers (which serve only health).
                for stub in (pb_grpc.PrefillWorkerStub(pool.channel("prefill-0")),
                             pb_grpc.DecodeWorkerStub(pool.channel("decode-1"))):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.Info(wpb.InfoRequest(), timeout=WAIT_S)
                    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            finally:
                await pool.close()

    run(body())


def test_a_worker_of_another_model_is_never_routable_and_logged_once(
        registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with fake_worker() as w:
            # The cluster serves another model (its fingerprint is that worker's layout),
            # so Redis lists the worker; the router serving MODEL must still ignore it.
            registry.register(make_record("decode-9", "decode", w.address,
                                          layout=FOREIGN_LAYOUT, total_kv_blocks=99))
            pool = new_pool(registry, FakeClock())
            try:
                with caplog.at_level(logging.INFO, LOGGER):
                    for _ in range(3):
                        await pool.refresh()
                        assert pool.routable("decode") == [] and pool.num_channels == 0
                        assert pool.layout() is None and pool.max_decode_blocks() == 0
            finally:
                await pool.close()

    run(body())
    mentions = [r for r in caplog.records if r.name == LOGGER and "decode-9" in r.getMessage()]
    assert len(mentions) == 1, [r.getMessage() for r in mentions]
    assert mentions[0].levelno == logging.WARNING
    assert "some-other-model" in mentions[0].getMessage() and MODEL in mentions[0].getMessage()


# -- health (row 22) -------------------------------------------------------------------------

def test_not_serving_workers_are_skipped_until_they_serve_again(
        registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with fake_worker() as w0, fake_worker(serving=False) as w1:
            registry.register(make_record("prefill-0", "prefill", w0.address))
            registry.register(make_record("prefill-1", "prefill", w1.address))
            pool = new_pool(registry, FakeClock())
            try:
                await pool.refresh()
                assert ids(pool.routable("prefill")) == ["prefill-0"]
                # A zombie: its server answers, its engine loop is dead.
                await w0.set_serving(False)
                await w1.set_serving(True)
                assert ids(pool.routable("prefill")) == ["prefill-0"]  # until the next refresh
                await pool.refresh()
                assert ids(pool.routable("prefill")) == ["prefill-1"]
                await w0.set_serving(True)
                await pool.refresh()
                assert ids(pool.routable("prefill")) == ["prefill-0", "prefill-1"]
                assert pool.num_channels == 2  # not serving does not close the channel
            finally:
                await pool.close()

    with caplog.at_level(logging.INFO, LOGGER):
        run(body())
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "worker prefill-0 is not serving: NOT_SERVING" in messages
    assert messages.count("worker prefill-0 is serving") == 2  # logged on changes only


def test_stopped_and_silent_workers_are_not_routable(registry: Registry) -> None:
    async def body() -> None:
        silent = silent_listener()
        try:
            async with fake_worker() as w0, fake_worker() as w1:
                registry.register(make_record("prefill-0", "prefill", w0.address))
                registry.register(make_record("prefill-1", "prefill", w1.address))
                registry.register(make_record(
                    "prefill-2", "prefill", f"127.0.0.1:{silent.getsockname()[1]}"))
                pool = new_pool(registry, FakeClock())
                try:
                    started = time.monotonic()
                    await pool.refresh()
                    elapsed = time.monotonic() - started
                    # The silent one never answers: its check times out, the others pass.
                    assert ids(pool.routable("prefill")) == ["prefill-0", "prefill-1"]
                    assert HEALTH_TIMEOUT_S * 0.9 <= elapsed < HEALTH_TIMEOUT_S + 3.0
                    await w1.server.stop(None)  # the process is gone
                    await pool.refresh()
                    assert ids(pool.routable("prefill")) == ["prefill-0"]
                    assert pool.num_channels == 3  # still registered: kept, not routed to
                finally:
                    await pool.close()
        finally:
            silent.close()

    run(body())


async def _unwatched_calls_survive(pool: WorkerPool, w1: Any, hung1: asyncio.Task[None],
                                   hang: Any, ch1: grpc.aio.Channel) -> None:
    """A call that left ``watched`` is not cancelled by a later failure."""
    w1.hanging.clear()
    hung1.cancel()
    await asyncio.wait([hung1], timeout=WAIT_S)
    await asyncio.wait_for(w1.hang_cancelled.wait(), WAIT_S)
    w1.hanging.clear()
    w1.hang_cancelled.clear()
    unwatched = asyncio.create_task(hang("decode-1", ch1, watch_until_done=False))
    await asyncio.wait_for(w1.hanging.wait(), WAIT_S)
    w1.hang_health_checks()
    for _ in range(HUNG_AFTER):
        await pool.refresh()
    assert pool.routable("decode") == []
    await asyncio.sleep(0.1)
    assert not unwatched.done() and not w1.hang_cancelled.is_set()
    unwatched.cancel()
    await asyncio.wait([unwatched], timeout=WAIT_S)


def test_watched_calls_are_cancelled_when_their_worker_fails_its_check(
        registry: Registry) -> None:
    async def body() -> None:
        async with fake_worker() as w0, fake_worker() as w1:
            registry.register(make_record("decode-0", "decode", w0.address))
            registry.register(make_record("decode-1", "decode", w1.address))
            pool = new_pool(registry, FakeClock())
            cancelling: dict[str, int] = {}
            try:
                await pool.refresh()
                assert ids(pool.routable("decode")) == ["decode-0", "decode-1"]
                async with grpc.aio.insecure_channel(w0.address) as ch0, \
                        grpc.aio.insecure_channel(w1.address) as ch1:
                    async def hang(worker_id: str, channel: grpc.aio.Channel,
                                   watch_until_done: bool = True) -> None:
                        call = channel.unary_unary(HANG_METHOD)(b"", timeout=WAIT_S * 2)
                        with pool.watched(worker_id, call):
                            if watch_until_done:
                                try:
                                    await call
                                except asyncio.CancelledError:
                                    task = asyncio.current_task()
                                    assert task is not None
                                    cancelling[worker_id] = task.cancelling()
                                    raise
                        await call  # no longer watched

                    hung0 = asyncio.create_task(hang("decode-0", ch0))
                    hung1 = asyncio.create_task(hang("decode-1", ch1))
                    await asyncio.wait_for(w0.hanging.wait(), WAIT_S)
                    await asyncio.wait_for(w1.hanging.wait(), WAIT_S)

                    # NOT_SERVING (draining, or a zombie failing its own calls): no new
                    # requests, but the calls it serves are left to finish
                    await w0.set_serving(False)
                    await pool.refresh()
                    assert ids(pool.routable("decode")) == ["decode-1"]
                    await asyncio.sleep(0.1)
                    assert not hung0.done()
                    # no answer at all (hung): after one missed check no new requests
                    # go there; after HUNG_AFTER in a row its calls are taken back
                    w0.hang_health_checks()
                    await pool.refresh()
                    await asyncio.sleep(0.1)
                    assert not hung0.done() and HUNG_AFTER > 1
                    for _ in range(HUNG_AFTER - 1):
                        await pool.refresh()
                    done, _ = await asyncio.wait([hung0], timeout=WAIT_S)
                    assert hung0 in done and hung0.cancelled()
                    assert cancelling == {"decode-0": 0}  # the pool cancelled the call, not us
                    await asyncio.wait_for(w0.hang_cancelled.wait(), WAIT_S)  # worker saw it
                    await asyncio.sleep(0.1)
                    assert not hung1.done()  # decode-1 is healthy: its call goes on

                    await _unwatched_calls_survive(pool, w1, hung1, hang, ch1)
            finally:
                await pool.close()

    run(body())


# -- the registry loses a worker (rows 19, 21) -----------------------------------------------

@pytest.mark.parametrize("how", ["deregistered", "expired", "redis-restarted"])
def test_a_worker_missing_from_redis_stays_for_keep_missing_s_then_is_forgotten(
        redis_server: RedisServer, registry: Registry, how: str) -> None:
    async def body() -> None:
        async with fake_worker() as w:
            record = make_record("prefill-0", "prefill", w.address)
            if how == "expired":
                with Registry(redis_server.url, ttl_s=1.0, heartbeat_s=0.5) as short_lived:
                    short_lived.register(record)
            else:
                registry.register(record)
            clock = FakeClock()
            pool = new_pool(registry, clock)
            try:
                await pool.refresh()
                assert ids(pool.routable("prefill")) == ["prefill-0"]
                old_stub = pb_grpc.PrefillWorkerStub(pool.channel("prefill-0"))

                if how == "deregistered":
                    registry.deregister("prefill-0")
                elif how == "expired":  # the worker stopped beating (row 21): the TTL runs out
                    deadline = time.monotonic() + WAIT_S
                    while registry.list_workers():
                        assert time.monotonic() < deadline, "the record never expired"
                        await asyncio.sleep(0.05)
                else:  # row 19: Redis lost everything
                    redis_server.restart()
                await refresh_fresh(pool)  # gone from Redis; last seen at the first refresh

                clock.advance(KEEP_MISSING_S - 0.5)
                await refresh_fresh(pool)
                assert ids(pool.routable("prefill")) == ["prefill-0"]  # traffic continues
                assert pool.num_channels == 1
                clock.advance(1.0)
                await refresh_fresh(pool)
                assert pool.routable("prefill") == [] and pool.num_channels == 0
                assert pool.layout() is None
                with pytest.raises(grpc.aio.UsageError, match="closed"):
                    await old_stub.Info(wpb.InfoRequest(), timeout=HEALTH_TIMEOUT_S)

                # It beats again: it rejoins at the next refresh, on a new channel.
                registry.register(record)
                await pool.refresh()
                assert ids(pool.routable("prefill")) == ["prefill-0"]
                assert pool.num_channels == 1
            finally:
                await pool.close()

    run(body())


@pytest.mark.parametrize("then", ["finishes", "comes-back"])
def test_a_lapsed_registration_keeps_the_channel_of_calls_in_flight(
        registry: Registry, then: str) -> None:
    # Defect: a worker whose registration lapsed (a delayed heartbeat) had its channel
    # closed, cancelling its healthy streams. Now it is only taken out of routing; the
    # channel closes once no call is in flight on it, or is reused when it comes back.
    async def body() -> None:
        async with fake_worker() as w:
            record = make_record("decode-0", "decode", w.address)
            registry.register(record)
            clock = FakeClock()
            pool = new_pool(registry, clock)
            try:
                await pool.refresh()
                channel = pool.channel("decode-0")
                call = channel.unary_unary(HANG_METHOD)(b"", timeout=WAIT_S * 2)
                task: asyncio.Task[bytes] | None = None

                async def stream() -> bytes:
                    with pool.busy("decode-0"), pool.watched("decode-0", call):
                        return bytes(await call)

                task = asyncio.create_task(stream())
                await asyncio.wait_for(w.hanging.wait(), WAIT_S)
                # 1. the record lapses for longer than keep_missing_s
                registry.deregister("decode-0")
                await refresh_fresh(pool)
                clock.advance(KEEP_MISSING_S + 1.0)
                await refresh_fresh(pool)
                # 2. no longer routable, but its call goes on, on the same open channel
                assert pool.routable("decode") == [] and pool.max_decode_blocks() == 0
                assert pool.num_channels == 1 and pool.channel("decode-0") is channel
                await asyncio.sleep(0.2)
                assert not task.done() and not w.hang_cancelled.is_set()
                if then == "comes-back":
                    # 3a. it beats again: routable on the same channel, the call unharmed
                    registry.register(record)
                    await pool.refresh()
                    assert ids(pool.routable("decode")) == ["decode-0"]
                    assert pool.channel("decode-0") is channel
                    assert not task.done() and not w.hang_cancelled.is_set()
                    call.cancel()
                    await asyncio.wait([task], timeout=WAIT_S)
                    await pool.refresh()
                    assert pool.num_channels == 1  # registered: kept, idle or not
                else:
                    # 3b. its last call ends: the next refresh closes the channel
                    call.cancel()
                    await asyncio.wait([task], timeout=WAIT_S)
                    assert task.done() and pool.inflight("decode-0") == 0
                    await refresh_fresh(pool)
                    assert pool.num_channels == 0
                    with pytest.raises(KeyError):
                        pool.channel("decode-0")
            finally:
                await pool.close()

    run(body())


# -- Redis unreachable (row 20) --------------------------------------------------------------

def test_an_unreachable_redis_keeps_the_last_known_good_workers(
        redis_server: RedisServer, registry: Registry) -> None:
    async def body() -> None:
        async with fake_worker() as p0, fake_worker() as d0:
            registry.register(make_record("prefill-0", "prefill", p0.address))
            registry.register(make_record("decode-0", "decode", d0.address))
            clock = FakeClock()
            pool = new_pool(registry, clock)
            try:
                await pool.refresh()
                assert ids(pool.routable("prefill")) == ["prefill-0"]

                redis_server.stop()
                for _ in range(3):  # minutes without Redis, refreshing all along
                    clock.advance(KEEP_MISSING_S * 10)
                    await pool.refresh()  # does not raise
                    assert ids(pool.routable("prefill")) == ["prefill-0"]
                    assert ids(pool.routable("decode")) == ["decode-0"]
                assert pool.view_age_s == KEEP_MISSING_S * 30  # stale: no fresh read since
                assert pool.num_channels == 2 and pool.layout() == LAYOUT

                # Health checks still decide: last-known-good *healthy* workers.
                await d0.set_serving(False)
                await pool.refresh()
                assert pool.routable("decode") == []
                await d0.set_serving(True)
                await pool.refresh()
                assert ids(pool.routable("decode")) == ["decode-0"]

                # Redis comes back empty (it restarted): the workers stay routable until
                # their next heartbeats refill it, well within keep_missing_s.
                redis_server.restart()
                clock.advance(1.0)
                await refresh_fresh(pool)
                assert ids(pool.routable("prefill")) == ["prefill-0"]
                assert ids(pool.routable("decode")) == ["decode-0"]
                registry.register(make_record("prefill-0", "prefill", p0.address))
                clock.advance(KEEP_MISSING_S + 1.0)
                await refresh_fresh(pool)  # decode-0 never came back; prefill-0 did
                assert ids(pool.routable("prefill")) == ["prefill-0"]
                assert pool.routable("decode") == [] and pool.num_channels == 1
            finally:
                await pool.close()

    run(body())


# -- suspects, load and closing --------------------------------------------------------------

def test_a_failed_worker_is_skipped_for_suspect_s(
        registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with fake_worker() as w0, fake_worker() as w1:
            registry.register(make_record("decode-0", "decode", w0.address))
            registry.register(make_record("decode-1", "decode", w1.address))
            clock = FakeClock()
            pool = new_pool(registry, clock)
            try:
                await pool.refresh()
                with caplog.at_level(logging.WARNING, LOGGER):
                    pool.mark_failed("decode-0", "UNAVAILABLE connection reset")
                    assert ids(pool.routable("decode")) == ["decode-1"]
                    clock.advance(SUSPECT_S / 2)
                    await pool.refresh()  # a passing health check does not clear it
                    assert ids(pool.routable("decode")) == ["decode-1"]
                    pool.mark_failed("decode-0", "again")  # extends, logged once
                    clock.advance(SUSPECT_S - 0.01)
                    assert ids(pool.routable("decode")) == ["decode-1"]
                    clock.advance(0.01)
                    assert ids(pool.routable("decode")) == ["decode-0", "decode-1"]
                    pool.mark_failed("decode-0", "third")  # a new suspect period: logged
            finally:
                await pool.close()

    run(body())
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2, messages
    assert "decode-0" in messages[0] and "UNAVAILABLE connection reset" in messages[0]


def test_a_worker_restarted_at_a_new_address_is_no_longer_suspect(registry: Registry) -> None:
    async def body() -> None:
        async with fake_worker() as old, fake_worker() as new:
            registry.register(make_record("prefill-0", "prefill", old.address))
            pool = new_pool(registry, FakeClock())
            try:
                await pool.refresh()
                pool.mark_failed("prefill-0", "UNAVAILABLE Socket closed")  # it died
                assert pool.routable("prefill") == []
                registry.register(make_record("prefill-0", "prefill", new.address))
                await pool.refresh()  # its successor registered: routable at once
                assert [r.grpc_address for r in pool.routable("prefill")] == [new.address]
            finally:
                await pool.close()

    run(body())


def test_a_prefill_rate_is_forgotten_when_its_worker_restarts_or_switches_role(
        registry: Registry) -> None:
    async def body() -> None:
        async with fake_worker() as old, fake_worker() as new:
            registry.register(make_record("prefill-0", "prefill", old.address))
            registry.register(make_record("prefill-1", "prefill", old.address))
            pool = new_pool(registry, FakeClock())
            try:
                await pool.refresh()
                pool.heard_from("prefill-0", 900.0)
                pool.heard_from("prefill-1", 400.0)
                registry.register(make_record("prefill-0", "prefill", old.address))
                await pool.refresh()  # the same process: what it reported holds
                assert pool.reported_rates() == {"prefill-0": 900.0, "prefill-1": 400.0}
                # a new process under prefill-0's id; prefill-1 now serves decode
                registry.register(make_record("prefill-0", "prefill", new.address))
                registry.register(make_record("prefill-1", "decode", old.address))
                await pool.refresh()
                assert pool.reported_rates() == {}
                # a new process at the same address (a fixed port, a stable host name)
                pool.heard_from("prefill-0", 900.0)
                registry.register(make_record("prefill-0", "prefill", new.address,
                                              started_at=1_700_000_100.0))
                await pool.refresh()
                assert pool.reported_rates() == {}
            finally:
                await pool.close()

    run(body())


def test_busy_counts_nested_and_failing_requests(registry: Registry) -> None:
    pool = new_pool(registry, FakeClock())  # no worker needed: counting only
    assert pool.inflight("decode-0") == 0 and pool.total_inflight == 0
    with pool.busy("decode-0"):
        assert pool.inflight("decode-0") == 1
        with pool.busy("decode-0"), pool.busy("prefill-0"):
            assert pool.inflight("decode-0") == 2 and pool.inflight("prefill-0") == 1
            assert pool.total_inflight == 3
        assert pool.inflight("decode-0") == 1 and pool.inflight("prefill-0") == 0
        with pytest.raises(RuntimeError, match="boom"), pool.busy("decode-0"):
            assert pool.inflight("decode-0") == 2
            raise RuntimeError("boom")
        assert pool.inflight("decode-0") == 1
    assert pool.inflight("decode-0") == 0 and pool.total_inflight == 0

    async def cancelled_while_busy() -> None:
        async def request() -> None:
            with pool.busy("decode-1"):
                await asyncio.sleep(60)

        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        assert pool.inflight("decode-1") == 1
        task.cancel()
        await asyncio.wait([task], timeout=WAIT_S)
        assert task.cancelled() and pool.inflight("decode-1") == 0

    run(cancelled_while_busy())
    assert pool.total_inflight == 0


def test_close_closes_every_channel(registry: Registry) -> None:
    async def body() -> None:
        async with fake_worker() as p0, fake_worker() as d0:
            registry.register(make_record("prefill-0", "prefill", p0.address))
            registry.register(make_record("decode-0", "decode", d0.address))
            pool = new_pool(registry, FakeClock())
            try:
                await pool.refresh()
                prefill_stub = pb_grpc.PrefillWorkerStub(pool.channel("prefill-0"))
                decode_stub = pb_grpc.DecodeWorkerStub(pool.channel("decode-0"))
                assert pool.num_channels == 2
            finally:
                await pool.close()
            assert pool.num_channels == 0 and pool.routable("prefill") == []
            with pytest.raises(grpc.aio.UsageError, match="closed"):
                await prefill_stub.Info(wpb.InfoRequest(), timeout=HEALTH_TIMEOUT_S)
            with pytest.raises(grpc.aio.UsageError, match="closed"):
                await decode_stub.Info(wpb.InfoRequest(), timeout=HEALTH_TIMEOUT_S)
            await pool.close()  # idempotent

    run(body())
