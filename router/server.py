"""``pdserve router``: the public gRPC server (``pdserve.v1``), health and reflection, and
the OpenAI-compatible HTTP API (``router.http``) on the same event loop.

``Router`` owns the asyncio gRPC server, the ``WorkerPool`` and its refresh task.
Health (``grpc.health.v1``, service "" and ``pdserve.v1.Generation``) is SERVING while at
least one decode worker and (unless ``--local-prefill`` lets decode workers prefill) one
prefill worker are routable. The router reads only ``config.json`` and ``tokenizer.json``
of ``--model`` (no weights) and imports no torch — except to build the built-in tiny
model when ``--model`` is not given.

Each attempt of a request has a lease in Redis (``cluster.leases.LeaseKeeper``, renewed
every ``--lease-ttl / 3``); with ``--debug-port`` the internal ``RouterDebug`` service
(``router.debug``) reports what the router holds.

Start-up fails at once, before touching Redis, when the port cannot be bound. SIGTERM or
SIGINT: stop accepting, give in-flight streams ``grace_s`` to finish (then they are
cancelled, which aborts them on the workers), close every channel, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.files import write_json_atomic
from cluster.fingerprint import fingerprint_model_dir
from cluster.internal_tls import internal_tls
from cluster.keepalive import SERVER_OPTIONS as KEEPALIVE_SERVER_OPTIONS
from cluster.leases import LeaseKeeper, LeaseStore
from cluster.registry import ClusterTokenRequired, Registry, RegistryAuthError, RegistryError
from cluster.token import load_cluster_token
from engine.text.tokenizer import load_tokenizer
from router.auth import api_key_interceptor, load_api_key
from router.config import (
    AdmissionConfig,
    DiscoveryConfig,
    HandoffConfig,
    HttpConfig,
    RouterConfig,
    TLSFiles,
)
from router.core import RouterCore
from router.debug import start_debug_server
from router.http.server import HttpServer, HttpStartError, build_http_server
from router.loop_lag import LoopLagMonitor
from router.resume import ResumeSeal, key_from_cluster_token
from router.service import SERVICE_NAME, GenerationService
from router.shared import SharedState
from router.validation import ModelLimits
from router.workers import WorkerPool

logger = logging.getLogger(__name__)
END_WAIT_S = 2.0  # for the streams ended at shutdown to tell their clients


PENDING_CALLS_MIN = 16384
"""Calls gRPC may hold for the router before it takes them (at least; 16 x --max-inflight)."""


class RouterStartError(RuntimeError):
    """The router could not start (port taken, bad model directory, Redis refused)."""


class Router:
    """One router process's server; ``start`` → ``wait_closed``/``stop``."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        try:
            info = load_tokenizer(config.model_dir)
            self.limits = ModelLimits.from_model_dir(config.model_dir, config.model_name, info)
            tokenizer = info.tokenizer
            fingerprint = fingerprint_model_dir(config.model_dir)
        except (OSError, ValueError) as exc:
            raise RouterStartError(f"cannot read model directory {config.model_dir}: {exc}"
                                   ) from None
        d = config.discovery
        self.registry = Registry(d.redis_url, cluster=d.cluster)
        self.pool = WorkerPool(self.registry, fingerprint, keep_missing_s=d.keep_missing_s,
                               suspect_s=d.suspect_s, token=config.cluster_token,
                               tls=config.internal_tls)
        self.leases = LeaseKeeper(LeaseStore(d.redis_url, cluster=d.cluster),
                                  config.handoff.lease_ttl_s)
        self.core = RouterCore(self.pool, self.limits, tokenizer, handoff=config.handoff,
                               admission=config.admission, leases=self.leases)
        self.shared = SharedState(config, self.pool, self.core)  # KV events, loads
        self.service = GenerationService(self.core)
        self.loop_lag = LoopLagMonitor(self.core.metrics.loop_lag)
        self.serving = False  # what health says (also the HTTP API's /health)
        self.http: HttpServer | None = None
        self.http_address: str | None = None
        if config.http is not None:
            try:
                self.http = build_http_server(config, self.core, tokenizer,
                                              lambda: self.serving)
            except HttpStartError as exc:
                raise RouterStartError(str(exc)) from None
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_address: str | None = None
        self._metrics_server: Any = None
        self.metrics_address: str | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._debug_server: grpc.aio.Server | None = None
        self.debug_address: str | None = None
        self.address = config.address
        self._own_resume_key = False  # resume tokens sealed with this router's own key
        self._token_marked_in: str | None = None  # run_id of the Redis it last marked

    async def start(self) -> str:
        """Binds, reads the workers once, starts serving; returns ``host:port``."""
        interceptors = [api_key_interceptor(self.config.api_key)] if self.config.api_key else []
        # gRPC core cancels calls past its pending (not yet handed to us) limit, 1000 by
        # default: a burst larger than that must reach admission, which answers every one
        # of them (OK or RESOURCE_EXHAUSTED), never a silent CANCELLED
        pending = max(PENDING_CALLS_MIN, 16 * self.config.admission.max_inflight)
        server = grpc.aio.server(interceptors=interceptors, options=(
            ("grpc.max_receive_message_length", self.config.admission.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", pending),
            *KEEPALIVE_SERVER_OPTIONS,  # a vanished client is noticed and its requests freed
        ))
        server.add_generic_rpc_handlers((self.service.handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            if self.config.tls is None:
                port = server.add_insecure_port(self.config.address)
            else:
                credentials = grpc.ssl_server_credentials([self.config.tls.credentials()])
                port = server.add_secure_port(self.config.address, credentials)
        except (RuntimeError, ValueError) as exc:
            raise RouterStartError(f"cannot listen on {self.config.address}: {exc}") from None
        if port == 0:
            raise RouterStartError(f"cannot listen on {self.config.address} (port in use?)")
        self.address = f"{self.config.host}:{port}"
        if self.http is not None:
            try:
                self.http_address = self.http.bind()
            except HttpStartError as exc:
                raise RouterStartError(str(exc)) from None
        try:
            await asyncio.to_thread(self.registry.ping)
            await asyncio.to_thread(self.registry.check_token,
                                    self.config.cluster_token is not None)
        except (RegistryAuthError, ClusterTokenRequired) as exc:
            raise RouterStartError(str(exc)) from None
        except Exception as exc:  # unreachable: keep going, the refresh loop retries
            logger.warning("Redis not reachable yet (%s); routing starts once it is", exc)
        keys = await self._resume_keys()
        self._own_resume_key = not keys  # no shared key yet: _refresh asks again
        self.core.seal = ResumeSeal(keys)
        if self.config.health_port is not None:
            await self._start_health_server()
        if self.config.metrics_port is not None:
            self._start_metrics_server(self.config.metrics_port)
        if self.config.debug_port is not None:
            try:
                self._debug_server, self.debug_address = await start_debug_server(
                    self.core, self.config.debug_host, self.config.debug_port,
                    self.config.api_key)
            except RuntimeError as exc:
                raise RouterStartError(str(exc)) from None
        self.leases.start()
        self.loop_lag.start()
        await self._refresh()
        await server.start()
        self._server = server
        if self.http is not None:
            await self.http.start()
        self._refresher = asyncio.create_task(self._refresh_forever())
        self.shared.start()
        return self.address

    def _start_metrics_server(self, port: int) -> None:
        """``/metrics`` (Prometheus text) on its own port, served from a thread."""
        try:
            server, _ = prometheus_client.start_http_server(port, self.config.host,
                                                            self.core.metrics.registry)
        except OSError as exc:
            raise RouterStartError(f"cannot serve metrics on {self.config.host}:{port}: "
                                   f"{exc.strerror or exc}") from None
        self._metrics_server = server
        self.metrics_address = f"{self.config.host}:{server.server_address[1]}"

    async def _start_health_server(self) -> None:
        """``grpc.health.v1`` alone, in plaintext, on ``health_port`` (probes of a TLS router)."""
        server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"{self.config.host}:{self.config.health_port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RouterStartError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise RouterStartError(f"cannot listen on {address} (port in use?)")
        await server.start()
        self._health_server = server
        self.health_address = f"{self.config.host}:{port}"

    async def _resume_keys(self) -> list[bytes]:
        """The cluster's resume keys (``router.resume``): of its cluster token, else shared
        through Redis, else (Redis unreachable) none — this router's own then."""
        token = self.config.cluster_token
        if token is not None:
            return [key_from_cluster_token(t) for t in token.tokens]
        try:
            return [await asyncio.to_thread(self.registry.resume_key)]
        except Exception as exc:  # noqa: BLE001 - resumes then work on this router alone
            logger.warning("no shared resume key (%s): streams this router serves can be "
                           "resumed on it alone", exc)
            return []

    async def _refresh(self) -> None:
        await self.pool.refresh()
        await self.shared.refreshed()
        colocated = self.config.handoff.local_prefill != "never"
        serving = bool(self.pool.routable("decode")
                       and (colocated or self.pool.routable("prefill")))
        self.serving = serving
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery.refresh_interval_s)
            try:
                await self._refresh()
                if self.config.cluster_token is None:
                    await self._share_resume_key()
                else:
                    await self._mark_token_required()
            except Exception:  # the loop must survive anything; log and go on
                logger.exception("refreshing the worker view failed")

    async def _mark_token_required(self) -> None:
        """Marks the cluster as requiring the token once in each Redis process (one that
        restarted without its data lost the mark, or Redis was away at this router's start),
        so no worker without it joins; a mark deleted from a running Redis stays deleted."""
        try:
            run_id = await asyncio.to_thread(self.registry.run_id)
            if run_id != self._token_marked_in:
                await asyncio.to_thread(self.registry.check_token, True)
                self._token_marked_in = run_id
        except RegistryError:
            pass  # Redis still away: next refresh

    async def _share_resume_key(self) -> None:
        """Takes up the cluster's shared resume key once Redis answers (its own, which
        sealed the streams served meanwhile, stays accepted); after, writes the key it
        seals with back where Redis lost it (a restart without persistence), so a router
        started then shares it rather than making another, under which it could not resume
        the others' streams."""
        seal = self.core.seal
        try:
            shared = await asyncio.to_thread(self.registry.resume_key, seal.sealing_key)
        except Exception:  # noqa: BLE001 - Redis still away: next refresh
            return
        if shared != seal.sealing_key:
            self.core.seal = seal.with_key(shared)
            logger.info("resume tokens now use the cluster's shared key")
        self._own_resume_key = False

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops accepting (health NOT_SERVING; a new request gets UNAVAILABLE, on both
        APIs, while the ports stay open), lets streams finish for ``grace_s``, ends those
        left with UNAVAILABLE (their clients resume them elsewhere, ``router.resume``),
        then closes the servers and releases everything."""
        if self._refresher is not None:
            self._refresher.cancel()
        self.shared.cancel()
        self.serving = False
        self.core.draining = True
        if self._server is not None:
            grace = self.config.grace_s if grace_s is None else grace_s
            started = time.monotonic()
            await self._health.enter_graceful_shutdown()
            if not await self.core.wait_idle(grace):  # end what is left: clients resume it
                logger.info("ending %d streams still served after the %.1fs grace",
                            self.core.end_all(), grace)
                await self.core.wait_idle(END_WAIT_S)
            await asyncio.gather(
                self._server.stop(max(0.0, grace - (time.monotonic() - started))),
                *([self.http.stop()] if self.http is not None else []))
        if self._health_server is not None:
            await self._health_server.stop(None)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        await self.core.drain_background()
        self.core.close()
        await self.leases.stop()
        await self.loop_lag.stop()
        if self.leases.store is not None:
            self.leases.store.close()
        if self._debug_server is not None:
            await self._debug_server.stop(None)
        await self.shared.stop()
        await self.pool.close()
        self.registry.close()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if not args.redis_url:
        raise ValueError("give --redis-url or $PDSERVE_REDIS_URL (the cluster's Redis)")
    return RouterConfig(
        model_dir=Path(args.model) if args.model else _demo_model_dir(), host=args.host, port=args.port,
        model_name=args.model_name, grace_s=args.grace,
        api_key=load_api_key(args.api_key_file), tls=_tls(args),
        discovery=DiscoveryConfig(redis_url=args.redis_url, cluster=args.cluster),
        admission=AdmissionConfig(max_inflight=args.max_inflight,
                                  max_queued_tokens=args.max_queued_tokens or None,
                                  max_buffered_chunks=args.max_buffered_chunks,
                                  max_n=args.max_n),
        handoff=HandoffConfig(local_prefill=args.local_prefill, lease_ttl_s=args.lease_ttl,
                              prefill_routing=args.prefill_routing,
                              local_prefill_max_tokens=args.local_prefill_max_tokens,
                              migration_limit=args.migration_limit),
        health_port=args.health_port, metrics_port=args.metrics_port, http=_http(args),
        debug_port=args.debug_port, debug_host=args.debug_host,
        cluster_token=load_cluster_token(args.cluster_token_file),
        internal_tls=internal_tls(args))


def _http(args: argparse.Namespace) -> HttpConfig | None:
    if not args.http:
        return None
    template = Path(args.chat_template) if args.chat_template else None
    return HttpConfig(port=args.http_port, chat_template=template)


def _tls(args: argparse.Namespace) -> TLSFiles | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    return None if args.tls_cert is None else TLSFiles(Path(args.tls_cert), Path(args.tls_key))


def _demo_model_dir() -> Path:
    from engine.testing.tiny_model import ensure_demo_model  # imports torch: only for this default

    return Path(ensure_demo_model())


def main(args: argparse.Namespace) -> int:
    """Runs the router until SIGTERM/SIGINT; exit 0 then, 1 when it cannot start."""
    from cluster.logs import configure_logging

    configure_logging("router")
    try:
        config = config_from_args(args)
        return asyncio.run(_serve(config, args.ready_file))
    except (RouterStartError, ValueError) as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 1


async def _serve(config: RouterConfig, ready_file: str | None) -> int:
    router = Router(config)
    address = await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_file:
        ready = {"grpc_address": address, "role": "router", "model": router.limits.name}
        for name in ("http_address", "health_address", "metrics_address", "debug_address"):
            if getattr(router, name) is not None:
                ready[name] = getattr(router, name)
        write_json_atomic(ready_file, ready)
    logger.info("serving %s on %s (%d prefill, %d decode workers known; %s)",
                router.limits.name, address, len(router.pool.routable("prefill")),
                len(router.pool.routable("decode")),
                "API key required" if config.api_key else "no API key")
    if config.tls is not None:
        logger.info("TLS on the public port (certificate %s)", config.tls.cert_file)
    await stop.wait()
    logger.info("stopping: %d requests in flight get %.1fs", router.core.inflight,
                config.grace_s)
    await router.stop()
    return 0
