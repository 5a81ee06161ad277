"""A real cluster for router tests: Redis, prefill and decode workers, the router.

All processes are started through the ``pdserve`` command line on loopback with small
KV pools, and stopped (bounded) by ``Cluster.close``. ``assert_no_leaks`` is the whole
cluster's leak check (``tests.leaks.assert_cluster_idle``: every worker, the router's
introspection and Redis), retried while freeing is under way. Every process gets a
test-only pause directory (``pause_dir``); the router serves its introspection on a
``--debug-port`` and keeps its leases for ``lease_ttl_s``. ``env`` goes into every process
started (e.g. ``$PDSERVE_CLUSTER_TOKEN``: then the cluster's own calls to workers carry
its first token).
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster.internal.v1 import worker_pb2 as wpb
from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
from cluster.pause_points import ENV as PAUSE_ENV
from cluster.token import CLUSTER_TOKEN_ENV
from deploy.redis_server import RedisServer
from tests.auth import with_token
from tests.leaks import assert_cluster_idle
from tests.processes import Proc, spawn, wait_until
from tests.worker.kv.faults import FIRST_OF_LENGTH_SPEC
from tests.worker.procs import assert_idle
from worker.process import FAULT_HOOK_ENV

NUM_KV_BLOCKS = 64
RPC_TIMEOUT_S = 30.0
WORKER_FLAGS = ("--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-batched-tokens", "32",
                "--transfer-timeout", "10", "--grace", "2", "--heartbeat-interval", "0.5",
                "--registration-ttl", "3")
# conditional disaggregation off: these clusters' tests send a prompt again and expect a
# prefill worker to compute it (a test of the local path gives its own threshold, which
# comes later on the command line and wins); ``pdserve up`` in tests keeps the default
ROUTER_FLAGS = ("--local-prefill-max-tokens", "0")


@dataclass
class Cluster:
    model_dir: Path
    tmp: Path
    redis: RedisServer
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    router: Proc | None = None
    lease_ttl_s: float = 10.0
    routers: list[Proc] = field(default_factory=list)  # every router started, live or not
    env: dict[str, str] = field(default_factory=dict)  # every process's, besides its own

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    def start_worker(self, role: str, index: int, *extra: str,
                     env: dict[str, str] | None = None) -> Proc:
        name = f"{role}-{index}"
        env = {**self.env, PAUSE_ENV: str(self.pause_dir(name)), **(env or {})}
        proc = spawn(name, [role, "--model", str(self.model_dir), "--redis-url", self.redis.url,
                            "--worker-id", name, *WORKER_FLAGS, *extra], self.tmp, env)
        (self.prefill if role == "prefill" else self.decode).append(proc)
        return proc

    def start_router(self, *extra: str, name: str = "router",
                     env: dict[str, str] | None = None,
                     flags: tuple[str, ...] = ROUTER_FLAGS) -> Proc:
        """A router (the cluster's ``router`` unless ``name`` differs): debug port, pause
        directory ``pause_dir(name)``, the cluster's lease TTL, ``flags`` (``ROUTER_FLAGS``;
        ``()``: the router's defaults); ``env`` over the cluster's."""
        router = spawn(name, ["router", "--model", str(self.model_dir), "--port", "0",
                              "--redis-url", self.redis.url, "--grace", "2", "--debug-port",
                              "0", "--lease-ttl", str(self.lease_ttl_s), *flags,
                              *extra], self.tmp,
                       {**self.env, PAUSE_ENV: str(self.pause_dir(name)), **(env or {})})
        self.routers.append(router)
        if name == "router":
            self.router = router
        return router.wait_ready()

    def with_router(self) -> Cluster:
        """The cluster, with its router running (started anew if a test killed it)."""
        if self.router is None or self.router.proc.poll() is not None:
            self.start_router()
            self.wait_serving()
        return self

    def wait_serving(self, timeout_s: float = 30.0) -> None:
        """Until the router sees every worker (health SERVING, then one more refresh)."""
        wait_until(lambda: _router_sees_all(self), timeout_s, "the router to see every worker")

    def pause_dir(self, process: int | str) -> Path:
        """The test-only pause directory of a process: a worker's name ("decode-0"), a
        router's ("router"), or an int for prefill worker ``prefill-<int>``."""
        name = f"prefill-{process}" if isinstance(process, int) else process
        path = self.tmp / f"pause-{name}"
        path.mkdir(exist_ok=True)
        return path

    def workers(self) -> list[Proc]:
        return [*self.prefill, *self.decode]

    def stub(self, worker: Proc) -> wpb_grpc.PrefillWorkerStub | wpb_grpc.DecodeWorkerStub:
        """A stub of ``worker``'s internal API (with the cluster token, if it has one)."""
        channel = with_token(worker.channel, self.env.get(CLUSTER_TOKEN_ENV))
        return (wpb_grpc.PrefillWorkerStub(channel) if worker.ready["role"] == "prefill"
                else wpb_grpc.DecodeWorkerStub(channel))

    def info(self, worker: Proc) -> wpb.WorkerInfo:
        return self.stub(worker).Info(wpb.InfoRequest(), timeout=RPC_TIMEOUT_S)

    def assert_no_leaks(self, workers: list[Proc] | None = None,
                        timeout_s: float = 15.0) -> None:
        """The whole cluster's leak check (``tests.leaks.assert_cluster_idle``): every live
        worker (of ``workers``, default all) idle; with every worker checked, also every
        live router's holdings and Redis (keys == live workers' records, no lease)."""
        live = [w for w in (self.workers() if workers is None else workers)
                if w.proc.poll() is None]
        if workers is not None or not self.redis.running:
            assert_idle(*(self.stub(w) for w in live), timeout_s=timeout_s)
            return
        routers = [r.ready["debug_address"] for r in self.routers
                   if r.proc.poll() is None and "debug_address" in r.ready]
        assert_cluster_idle([self.stub(w) for w in live], routers, self.redis.url,
                            [w.name for w in live], timeout_s=timeout_s)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.routers + self.workers():
            proc.stop()
        self.redis.stop()


def start_cluster(model_dir: Path, tmp: Path, *, num_prefill: int, num_decode: int,
                  decode_tp: int, router_args: tuple[str, ...] = (),
                  decode_kv_blocks: int = NUM_KV_BLOCKS,
                  decode_args: tuple[str, ...] = (),
                  prefill_args: tuple[str, ...] = (), lease_ttl_s: float = 10.0,
                  env: dict[str, str] | None = None) -> Cluster:
    redis = RedisServer(start_timeout_s=10.0)
    redis.start()
    cluster = Cluster(model_dir, tmp, redis, lease_ttl_s=lease_ttl_s, env=dict(env or {}))
    try:
        for i in range(num_decode):
            cluster.start_worker("decode", i, "--tensor-parallel-size", str(decode_tp),
                                 "--num-kv-blocks", str(decode_kv_blocks), *decode_args)
        for i in range(num_prefill):
            # pause points (tests arm them in pause_dir(i)); prefill-0 also corrupts the
            # first KV transfer of a CORRUPT_NUM_TOKENS-token prompt
            env = {}
            if i == 0:
                env[FAULT_HOOK_ENV] = FIRST_OF_LENGTH_SPEC
            cluster.start_worker("prefill", i, *prefill_args, env=env)
        for worker in cluster.workers():
            worker.wait_ready()
        cluster.start_router(*router_args)
        cluster.wait_serving()
    except BaseException:
        cluster.close()
        raise
    return cluster


def scrape_metrics(address: str, *, keep_model_name: bool = False) -> dict[str, float]:
    """A ``/metrics`` endpoint's samples: ``name{label=value,...}`` (labels sorted, the
    ``model_name`` label left out unless ``keep_model_name``) → value."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if keep_model_name or k != "model_name")
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def _router_sees_all(cluster: Cluster) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5.0)
    time.sleep(0.6)  # one more refresh: health needs one worker per role, we want all
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
