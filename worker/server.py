"""What the prefill and decode worker processes share on their gRPC side, torch-free:
the asyncio gRPC server, the ready file, health, Redis registration after readiness, the
SIGTERM wait and drain (``serve_until_signal``), and with Redis the lease watcher
(``worker.leases``: attempts whose router-owned lease is gone are freed). The engine side of a worker process is
``worker.process``; the engine-loop thread and its commands are ``worker.loop``; the
protobuf adapters ``worker.servicer``.

Health means "can make progress": SERVING while the engine loop runs and either has no
work or completed a step within ``--stall-timeout`` seconds; NOT_SERVING when it is dead
(a rank died, a step failed), stalled, or the worker is draining. A busy worker is
healthy: the server is ``grpc.aio``, so no number of open streams or pending calls delays
a health check, an ``Abort``, an ``Info`` or a ``Reserve``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.auth import cluster_token_interceptor
from cluster.files import write_json_atomic
from cluster.heartbeat import Heartbeat
from cluster.internal_tls import InternalTLS
from cluster.keepalive import INTERNAL_SERVER_OPTIONS
from cluster.leases import LeaseStore
from cluster.records import WorkerLoad, WorkerRecord
from cluster.registry import FingerprintMismatch, Registry
from cluster.token import ClusterToken
from engine.kvcache.layout import KVLayout
from worker.drain import move_out, others_decoding
from worker.leases import LeaseWatcher
from worker.loop import Abort, EngineLoop
from worker.metrics import WorkerMetrics
from worker.options import advertise_host

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5


# ------------------------------------------------------------------------ process glue

@dataclass(frozen=True)
class ReadyInfo:
    """What ``--ready-file`` holds (JSON) once the worker is ready."""

    grpc_address: str
    kv_address: str
    worker_id: str
    role: str
    metrics_address: str = ""

    def write(self, path: str | Path) -> None:
        """Atomic: readers never see a partial file."""
        write_json_atomic(path, asdict(self))

    @classmethod
    def read(cls, path: str | Path) -> ReadyInfo:
        return cls(**json.loads(Path(path).read_text()))


class Health:
    """The worker's ``grpc.health.v1`` status (service "" only), set from the event loop."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.serving = False

    async def set(self, serving: bool) -> None:
        self.serving = serving
        await self.servicer.set("", health_pb2.HealthCheckResponse.SERVING if serving
                                else health_pb2.HealthCheckResponse.NOT_SERVING)


def progress_problem(loop: EngineLoop, stall_timeout_s: float) -> str | None:
    """Why the engine loop cannot make progress (None: it can)."""
    if not loop.alive:
        return f"the engine loop is dead: {loop.error!r}"
    stalled = loop.stalled_s()
    if stalled > stall_timeout_s:
        return f"the engine loop completed no step for {stalled:.1f}s with work pending"
    return None


async def watch_progress(health_: Health, loop: EngineLoop, stall_timeout_s: float) -> None:
    """Keeps health at "can make progress" (see module doc) until cancelled."""
    while True:
        problem = progress_problem(loop, stall_timeout_s)
        if (problem is None) != health_.serving:
            if problem is None:
                log.info("the engine loop makes progress again: SERVING")
            else:
                log.warning("%s: NOT_SERVING", problem)
            await health_.set(problem is None)
        await asyncio.sleep(WATCH_PERIOD_S)


def run_guarded(what: str, fn: Callable[[], object]) -> None:
    """Shutdown step that must not stop the next one: log and go on."""
    try:
        fn()
    except Exception:
        log.exception("shutdown: %s failed", what)


# ------------------------------------------------------------------------ serving

@dataclass(frozen=True)
class Identity:
    """Who a worker is, for ``Info``, the ready file and registration."""

    worker_id: str
    role: str
    tensor_parallel_size: int
    model_fingerprint: str


@dataclass(frozen=True)
class Endpoint:
    """What ``serve_until_signal`` needs besides the running loop."""

    identity: Identity
    layout: KVLayout
    kv_address: str  # "" when the worker has no KV endpoint (prefill)
    add_servicers: Callable[[grpc.aio.Server], None]
    load_fn: Callable[[], WorkerLoad]
    metrics: WorkerMetrics
    token: ClusterToken | None = None  # every call but health must carry it (None: open)
    tls: InternalTLS | None = None  # serve mutual TLS (None: plaintext)


def serve_until_signal(args: Any, loop: EngineLoop, endpoint: Endpoint) -> int:
    """Serve gRPC (+ health) on ``args.host:args.port`` until SIGTERM/SIGINT, then stop;
    the address registered and written to the ready file is ``--advertise-host``'s.

    Order: server up → registration (``--redis-url``; a fingerprint mismatch exits 3
    naming the field — at once, or when a later heartbeat keeps finding one, after
    draining — as do invalid ``--heartbeat-interval``/``--registration-ttl``; Redis down:
    the heartbeat waits to join) →
    SERVING → ready file → wait. Stop: NOT_SERVING, with Redis the planned moves of its
    decoding requests' KV to other decode workers (``worker.drain``), deregister, refuse
    new RPCs and give in-flight ones what is left of ``args.grace`` seconds, cancel the
    rest (their cancellation aborts their requests), then stop the loop (aborts what is left, shuts the engine and its
    ranks down). Returns the exit code.
    """
    metrics_server, _ = prometheus_client.start_http_server(
        args.metrics_port, args.host, endpoint.metrics.registry)
    metrics_address = f"{advertise_host(args)}:{metrics_server.server_address[1]}"
    try:
        return asyncio.run(_serve(args, loop, endpoint, metrics_address))
    finally:
        loop.stop()
        metrics_server.shutdown()
        metrics_server.server_close()


async def _serve(args: Any, loop: EngineLoop, endpoint: Endpoint, metrics_address: str) -> int:
    interceptors = [] if endpoint.token is None else [cluster_token_interceptor(endpoint.token)]
    server = grpc.aio.server(options=INTERNAL_SERVER_OPTIONS, interceptors=interceptors)
    endpoint.add_servicers(server)
    health_ = Health(server)
    await health_.set(False)
    bind = f"{args.host}:{args.port}"
    port = (server.add_insecure_port(bind) if endpoint.tls is None
            else server.add_secure_port(bind, endpoint.tls.server_credentials()))
    await server.start()
    identity = endpoint.identity
    grpc_address = f"{advertise_host(args)}:{port}"
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    heartbeat: Heartbeat | None = None
    watcher: asyncio.Task[None] | None = None
    leases: LeaseWatcher | None = None
    try:
        if args.redis_url:
            aio_loop = asyncio.get_running_loop()

            def refused(_: FingerprintMismatch) -> None:  # at a later beat: stop, exit 3
                aio_loop.call_soon_threadsafe(stop.set)

            heartbeat = await asyncio.to_thread(_register, args, endpoint, grpc_address,
                                                metrics_address, refused)
            if heartbeat is None:
                return 3
            loop.role_listeners.append(heartbeat.set_role)  # the record follows a switch
            loop.move_targets = functools.partial(others_decoding, heartbeat, identity.worker_id)
            leases = start_lease_watcher(args, loop)
        await health_.set(True)
        watcher = asyncio.create_task(watch_progress(health_, loop, args.stall_timeout))
        if args.ready_file:
            ReadyInfo(grpc_address, endpoint.kv_address, identity.worker_id,
                      identity.role, metrics_address).write(args.ready_file)
        log.info("%s worker %s ready on %s", identity.role, identity.worker_id, grpc_address)
        await stop.wait()
        log.info("received a signal: shutting down")
    finally:
        if watcher is not None:
            watcher.cancel()
        await health_.set(False)
        draining_at = time.monotonic()
        if heartbeat is not None and heartbeat.refused is None \
                and getattr(args, "drain_moves", True):  # its decoding requests move
            await move_out(loop, heartbeat, identity.worker_id, args.grace)
        if heartbeat is not None:
            await asyncio.to_thread(run_guarded, "deregistering", heartbeat.stop)
        start = time.monotonic()
        await server.stop(max(0.0, args.grace - (start - draining_at)))
        log.info("gRPC server stopped in %.2fs", time.monotonic() - start)
        if leases is not None:  # only now: a dead router's attempt is freed during the grace
            await asyncio.to_thread(run_guarded, "stopping the lease watcher", leases.stop)
    if heartbeat is not None and heartbeat.refused is not None:
        print(f"pdserve {identity.role}: left the cluster: {heartbeat.refused} "
              f"(differing field: {heartbeat.refused.field})", file=sys.stderr)
        return 3
    return 0


def start_lease_watcher(args: Any, loop: EngineLoop) -> LeaseWatcher:
    """Frees the attempts whose router-owned lease is gone (``worker.leases``)."""
    def abort(attempt_id: str) -> None:
        loop.post(Abort(attempt_id, "its lease is gone: the router that owned it died or "
                        "lost it"))

    return LeaseWatcher(LeaseStore(args.redis_url, cluster=args.cluster), loop.leases,
                        abort).start()


def _register(args: Any, endpoint: Endpoint, grpc_address: str, metrics_address: str,
              on_mismatch: Callable[[FingerprintMismatch], None]) -> Heartbeat | None:
    """Start the heartbeat; None (after a message naming the field) on a fingerprint
    mismatch or invalid heartbeat/TTL settings."""
    identity = endpoint.identity
    load = endpoint.load_fn()
    record = WorkerRecord(
        worker_id=identity.worker_id, role=identity.role, grpc_address=grpc_address,
        kv_address=endpoint.kv_address or grpc_address,
        tensor_parallel_size=identity.tensor_parallel_size, layout=endpoint.layout,
        free_kv_blocks=load.free_kv_blocks, total_kv_blocks=load.total_kv_blocks,
        num_running=load.num_running, num_waiting=load.num_waiting, started_at=time.time(),
        metrics_address=metrics_address)
    timing = {k: v for k, v in (("heartbeat_s", args.heartbeat_interval),
                                ("ttl_s", args.registration_ttl)) if v is not None}
    try:
        registry = Registry(args.redis_url, cluster=args.cluster, **timing)
    except ValueError as exc:  # e.g. a heartbeat interval not shorter than the TTL
        print(f"pdserve {identity.role}: {exc}", file=sys.stderr)
        return None
    try:
        return Heartbeat(registry, record, endpoint.load_fn, on_mismatch=on_mismatch).start()
    except FingerprintMismatch as exc:
        print(f"pdserve {identity.role}: not joining the cluster: {exc} "
              f"(differing field: {exc.field})", file=sys.stderr)
        return None
