"""Worker registration through real processes: a worker appears in Redis only once
ready, a differing fingerprint keeps it out, a frozen worker expires after its TTL and
returns, and a restarted Redis is refilled within one heartbeat."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import redis

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.registry import Registry, RegistryError
from deploy.redis_server import RedisServer
from tests.processes import START_TIMEOUT_S, STOP_TIMEOUT_S, Proc, wait_until
from tests.worker.procs import NUM_KV_BLOCKS, RPC_TIMEOUT_S, spawn_worker

pytestmark = pytest.mark.timeout(300)


def test_registers_once_ready_and_refuses_a_differing_fingerprint(
        llama_dir: Path, tmp_path: Path) -> None:
    workers: list[Proc] = []
    with RedisServer(start_timeout_s=10.0) as redis_server, Registry(redis_server.url) as registry:
        try:
            # 1. a worker registers once ready (its ready file is written after the record)
            good = spawn_worker("prefill", llama_dir, tmp_path, "--redis-url", redis_server.url,
                                "--worker-id", "prefill-a")
            workers.append(good)
            good.wait_ready()
            (record,) = registry.list_workers()
            assert good.ready and record.grpc_address == good.address
            assert (record.worker_id, record.role, record.total_kv_blocks) == \
                ("prefill-a", "prefill", NUM_KV_BLOCKS)
            # 2. another KV layout (block size): it exits naming the field, unregistered
            other_dir = tmp_path / "other"
            other_dir.mkdir()
            bad = spawn_worker("prefill", llama_dir, other_dir, "--redis-url", redis_server.url,
                               "--worker-id", "prefill-b", "--block-size", "32")
            workers.append(bad)
            assert bad.proc.wait(START_TIMEOUT_S) != 0
            assert "block_size" in bad.log_tail()
            assert not (other_dir / "prefill.ready.json").exists()
            assert [r.worker_id for r in registry.list_workers()] == ["prefill-a"]
            # 3. SIGTERM: exits 0 and deregisters
            good.proc.send_signal(signal.SIGTERM)
            assert good.proc.wait(STOP_TIMEOUT_S) == 0, good.log_tail()
            assert registry.list_workers() == []
        finally:
            for w in workers:
                w.stop()


def test_the_advertised_host_is_what_others_reach(llama_dir: Path, tmp_path: Path) -> None:
    # 1. a wildcard --host without --advertise-host is refused before anything starts
    refused = spawn_worker("decode", llama_dir, tmp_path, "--host", "0.0.0.0", name="wild")
    assert refused.proc.wait(60) == 2
    assert "--advertise-host" in refused.log_tail()
    # 2. what is registered and written to the ready file is the advertised host
    with RedisServer(start_timeout_s=10.0) as redis_server, Registry(redis_server.url) as registry:
        worker = spawn_worker("decode", llama_dir, tmp_path, "--redis-url", redis_server.url,
                              "--advertise-host", "localhost", "--worker-id", "decode-l")
        try:
            worker.wait_ready()
            (record,) = registry.list_workers()
            assert record.grpc_address.startswith("localhost:")
            assert record.kv_address.startswith("localhost:")
            assert worker.ready["kv_address"] == record.kv_address
            stub = pb_grpc.DecodeWorkerStub(worker.channel)  # reachable there
            assert stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S).worker_id == "decode-l"
        finally:
            worker.stop()


HEARTBEAT_S, TTL_S = 0.2, 1.0  # the short-TTL workers below


def _spawn_registered(llama_dir: Path, tmp: Path, redis_url: str, worker_id: str) -> Proc:
    worker = spawn_worker("prefill", llama_dir, tmp, "--redis-url", redis_url, "--worker-id",
                   worker_id, "--heartbeat-interval", str(HEARTBEAT_S),
                   "--registration-ttl", str(TTL_S))
    try:
        worker.wait_ready()
    except BaseException:
        worker.stop()
        raise
    return worker


def _ids_of(registry: Registry) -> list[str]:
    return [r.worker_id for r in registry.list_workers()]


def test_frozen_worker_expires_and_comes_back(llama_dir: Path, tmp_path: Path) -> None:
    # 1. SIGSTOP: no more heartbeats, the record is gone after its TTL;
    # 2. SIGCONT: the next beat (due at once) writes it again
    with RedisServer(start_timeout_s=10.0) as redis_server, Registry(redis_server.url) as registry:
        worker = _spawn_registered(llama_dir, tmp_path, redis_server.url, "prefill-frozen")
        try:
            assert _ids_of(registry) == ["prefill-frozen"]
            worker.proc.send_signal(signal.SIGSTOP)
            gone = wait_until(lambda: _ids_of(registry) == [], TTL_S + 10.0, "expiry",
                              period_s=0.02, ignore=(RegistryError,))
            assert gone <= TTL_S + 1.0, gone
            worker.proc.send_signal(signal.SIGCONT)
            back = wait_until(lambda: _ids_of(registry) == ["prefill-frozen"],
                              10.0, "re-registration", period_s=0.02, ignore=(RegistryError,))
            assert back <= HEARTBEAT_S + 1.0, back
            stub = pb_grpc.PrefillWorkerStub(worker.channel)
            assert stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S).worker_id == \
                "prefill-frozen"
        finally:
            worker.stop()


def test_worker_reregisters_after_redis_restart(llama_dir: Path, tmp_path: Path) -> None:
    # Redis comes back empty: the heartbeat writes the record and the fingerprint again
    with RedisServer(start_timeout_s=10.0) as redis_server, Registry(redis_server.url) as registry:
        worker = _spawn_registered(llama_dir, tmp_path, redis_server.url, "prefill-r")
        try:
            assert _ids_of(registry) == ["prefill-r"]
            layout = registry.cluster_layout()
            assert layout is not None
            with redis.Redis.from_url(redis_server.url) as client:
                client.set("sentinel", "1")
            redis_server.restart()
            with redis.Redis.from_url(redis_server.url) as client:
                assert client.get("sentinel") is None  # the data is gone
            back = wait_until(lambda: _ids_of(registry) == ["prefill-r"]
                              and registry.cluster_layout() == layout, 10.0, "re-registration",
                              period_s=0.02, ignore=(RegistryError,))
            assert back <= HEARTBEAT_S + 2.0, back  # one beat (+ a reconnect)
            (record,) = registry.list_workers()
            assert worker.ready and record.grpc_address == worker.address
            stub = pb_grpc.PrefillWorkerStub(worker.channel)
            info = stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
            assert (info.worker_id, info.kv.total_blocks) == ("prefill-r", NUM_KV_BLOCKS)
            assert worker.proc.poll() is None, worker.log_tail()
        finally:
            worker.stop()
