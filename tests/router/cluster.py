"""A real cluster for router tests: Redis, prefill and decode workers, the router.

All processes are started through the ``pdserve`` command line on loopback with small
KV pools, and stopped (bounded) by ``Cluster.close``. ``assert_no_leaks`` asks every
worker's ``Info`` until nothing is held (aborts travel asynchronously).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from cluster.internal.v1 import worker_pb2 as wpb
from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
from pdserve.redis_server import RedisServer
from prefill_worker.server import FAULT_HOOK_ENV
from tests.processes import Proc, spawn, wait_until
from tests.worker.kv_faults import FIRST_OF_LENGTH_SPEC
from tests.worker.procs import assert_idle
from cluster.pause_points import ENV as PAUSE_ENV

NUM_KV_BLOCKS = 64
RPC_TIMEOUT_S = 30.0
WORKER_FLAGS = ("--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-batched-tokens", "32",
                "--transfer-timeout", "10", "--grace", "2", "--heartbeat-interval", "0.5",
                "--registration-ttl", "3")


@dataclass
class Cluster:
    model_dir: Path
    tmp: Path
    redis: RedisServer
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    router: Proc | None = None

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    def start_worker(self, role: str, index: int, *extra: str,
                     env: dict[str, str] | None = None) -> Proc:
        name = f"{role}-{index}"
        proc = spawn(name, [role, "--model", str(self.model_dir), "--redis-url", self.redis.url,
                            "--worker-id", name, *WORKER_FLAGS, *extra], self.tmp, env)
        (self.prefill if role == "prefill" else self.decode).append(proc)
        return proc

    def start_router(self, *extra: str) -> Proc:
        self.router = spawn("router", ["router", "--model", str(self.model_dir), "--port", "0",
                                       "--redis-url", self.redis.url, "--grace", "2", *extra],
                             self.tmp)
        return self.router.wait_ready()

    def pause_dir(self, prefill_index: int) -> Path:
        """The test-only pause directory of prefill worker ``prefill_index``."""
        path = self.tmp / f"pause-prefill-{prefill_index}"
        path.mkdir(exist_ok=True)
        return path

    def workers(self) -> list[Proc]:
        return [*self.prefill, *self.decode]

    def stub(self, worker: Proc) -> wpb_grpc.PrefillWorkerStub | wpb_grpc.DecodeWorkerStub:
        return (wpb_grpc.PrefillWorkerStub(worker.channel) if worker.ready["role"] == "prefill"
                else wpb_grpc.DecodeWorkerStub(worker.channel))

    def info(self, worker: Proc) -> wpb.WorkerInfo:
        return self.stub(worker).Info(wpb.InfoRequest(), timeout=RPC_TIMEOUT_S)

    def assert_no_leaks(self, workers: list[Proc] | None = None,
                        timeout_s: float = 15.0) -> None:
        """Every live worker (of ``workers``, default all) is idle: the worker layer's
        leak check (``tests.worker.procs.assert_idle``)."""
        live = [w for w in (self.workers() if workers is None else workers)
                if w.proc.poll() is None]
        assert_idle(*(self.stub(w) for w in live), timeout_s=timeout_s)

    def close(self) -> None:
        for proc in ([self.router] if self.router else []) + self.workers():
            proc.stop()
        self.redis.stop()


def start_cluster(model_dir: Path, tmp: Path, *, num_prefill: int, num_decode: int,
                  decode_tp: int, router_args: tuple[str, ...] = (),
                  decode_kv_blocks: int = NUM_KV_BLOCKS,
                  decode_args: tuple[str, ...] = (),
                  prefill_args: tuple[str, ...] = ()) -> Cluster:
    redis = RedisServer(start_timeout_s=10.0)
    redis.start()
    cluster = Cluster(model_dir, tmp, redis)
    try:
        for i in range(num_decode):
            cluster.start_worker("decode", i, "--tensor-parallel-size", str(decode_tp),
                                 "--num-kv-blocks", str(decode_kv_blocks), *decode_args)
        for i in range(num_prefill):
            # pause points (tests arm them in pause_dir(i)); prefill-0 also corrupts the
            # first KV transfer of a CORRUPT_NUM_TOKENS-token prompt
            env = {PAUSE_ENV: str(cluster.pause_dir(i))}
            if i == 0:
                env[FAULT_HOOK_ENV] = FIRST_OF_LENGTH_SPEC
            cluster.start_worker("prefill", i, *prefill_args, env=env)
        for worker in cluster.workers():
            worker.wait_ready()
        cluster.start_router(*router_args)
        wait_until(lambda: _router_sees_all(cluster), 30.0, "the router to see every worker")
    except BaseException:
        cluster.close()
        raise
    return cluster


def _router_sees_all(cluster: Cluster) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5.0)
    time.sleep(0.6)  # one more refresh: health needs one worker per role, we want all
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
