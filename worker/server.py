"""What the prefill and decode worker processes share on their gRPC side, torch-free:
the ready file, readiness and health, Redis registration after readiness, the SIGTERM wait
and drain (``serve_until_signal``). The engine side of a worker process is
``worker.process``; the engine-loop thread and its commands are ``worker.loop``; the
protobuf adapters ``worker.servicer``.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.files import write_json_atomic
from cluster.heartbeat import Heartbeat
from cluster.records import WorkerLoad, WorkerRecord
from cluster.registry import FingerprintMismatch, Registry
from kvtransfer.layout import KVLayout
from worker.loop import EngineLoop
from worker.options import advertise_host

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------ process glue

@dataclass(frozen=True)
class ReadyInfo:
    """What ``--ready-file`` holds (JSON) once the worker is ready."""

    grpc_address: str
    kv_address: str
    worker_id: str
    role: str

    def write(self, path: str | Path) -> None:
        """Atomic: readers never see a partial file."""
        write_json_atomic(path, asdict(self))

    @classmethod
    def read(cls, path: str | Path) -> ReadyInfo:
        return cls(**json.loads(Path(path).read_text()))


def start_health(server: grpc.Server) -> health.HealthServicer:
    """Adds ``grpc.health.v1`` to ``server``; NOT_SERVING until ``set_serving``."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    set_serving(servicer, False)
    return servicer


def set_serving(servicer: health.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer.set("", status)


def watch_loop(servicer: health.HealthServicer, loop: EngineLoop,
               stop: threading.Event, period_s: float = 0.5) -> None:
    """Daemon thread: health turns NOT_SERVING once the engine loop is dead (zombie)."""
    def run() -> None:
        while not stop.wait(period_s):
            if not loop.alive:
                set_serving(servicer, False)
                return
    threading.Thread(target=run, name="pdserve-health-watch", daemon=True).start()


def wait_for_signal(stop: threading.Event) -> None:
    """Sets ``stop`` on SIGTERM or SIGINT (main thread only) and waits for it."""
    def handler(signum: int, _frame: object) -> None:
        log.info("received signal %d: shutting down", signum)
        stop.set()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop.wait(0.5):
        pass


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
    add_servicers: Callable[[grpc.Server], None]
    load_fn: Callable[[], WorkerLoad]


def serve_until_signal(args: Any, loop: EngineLoop, endpoint: Endpoint) -> int:
    """Serve gRPC (+ health) on ``args.host:args.port`` until SIGTERM/SIGINT, then stop;
    the address registered and written to the ready file is ``--advertise-host``'s.

    Order: server up → registration (``--redis-url``; a fingerprint mismatch exits 3
    naming the field, as do invalid ``--heartbeat-interval``/``--registration-ttl``) →
    SERVING → ready file → wait. Stop: NOT_SERVING, deregister, refuse new RPCs and give
    in-flight ones ``args.grace`` seconds, cancel the rest (their cancellation aborts
    their requests), then stop the loop (aborts what is left, shuts the engine and its
    ranks down). Returns the exit code.
    """
    server = grpc.server(ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdserve-rpc"))
    endpoint.add_servicers(server)
    health_servicer = start_health(server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    identity = endpoint.identity
    grpc_address = f"{advertise_host(args)}:{port}"
    heartbeat = None
    stop = threading.Event()
    try:
        if args.redis_url:
            heartbeat = _register(args, endpoint, grpc_address)
            if heartbeat is None:
                return 3
        set_serving(health_servicer, True)
        watch_loop(health_servicer, loop, stop)
        if args.ready_file:
            ReadyInfo(grpc_address, endpoint.kv_address, identity.worker_id,
                      identity.role).write(args.ready_file)
        log.info("%s worker %s ready on %s", identity.role, identity.worker_id, grpc_address)
        wait_for_signal(stop)
    finally:
        stop.set()
        set_serving(health_servicer, False)
        if heartbeat is not None:
            run_guarded("deregistering", heartbeat.stop)
        start = time.monotonic()
        server.stop(args.grace).wait(args.grace + 5.0)
        log.info("gRPC server stopped in %.2fs", time.monotonic() - start)
        loop.stop()
    return 0


def _register(args: Any, endpoint: Endpoint, grpc_address: str) -> Heartbeat | None:
    """Start the heartbeat; None (after a message naming the field) on a fingerprint
    mismatch or invalid heartbeat/TTL settings."""
    identity = endpoint.identity
    load = endpoint.load_fn()
    record = WorkerRecord(
        worker_id=identity.worker_id, role=identity.role, grpc_address=grpc_address,
        kv_address=endpoint.kv_address or grpc_address,
        tensor_parallel_size=identity.tensor_parallel_size, layout=endpoint.layout,
        free_kv_blocks=load.free_kv_blocks, total_kv_blocks=load.total_kv_blocks,
        num_running=load.num_running, num_waiting=load.num_waiting, started_at=time.time())
    timing = {k: v for k, v in (("heartbeat_s", args.heartbeat_interval),
                                ("ttl_s", args.registration_ttl)) if v is not None}
    try:
        registry = Registry(args.redis_url, cluster=args.cluster, **timing)
    except ValueError as exc:  # e.g. a heartbeat interval not shorter than the TTL
        print(f"pdserve {identity.role}: {exc}", file=sys.stderr)
        return None
    try:
        return Heartbeat(registry, record, endpoint.load_fn).start()
    except FingerprintMismatch as exc:
        print(f"pdserve {identity.role}: not joining the cluster: {exc} "
              f"(differing field: {exc.field})", file=sys.stderr)
        return None
