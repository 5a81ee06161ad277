"""The router's introspection service (``pdserve.internal.v1.RouterDebug``): what this
router holds right now, for leak checks and debugging. A thin gRPC adapter.

Internal only: served on its own plaintext port (``--debug-port``), never on the public
API port, bound to ``--debug-host`` (loopback by default, whatever ``--host`` is); with
an API key set it requires the key, as the public API does.
"""

from __future__ import annotations

import grpc

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from router.auth import api_key_interceptor
from router.core import RouterCore


class RouterDebugServicer(pb_grpc.RouterDebugServicer):
    """``Holdings`` over one router's ``RouterCore`` (its admission, leases, aborts, pool)."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core

    async def Holdings(self, request: pb.InfoRequest,  # noqa: N802 - gRPC name
                       context: grpc.aio.ServicerContext) -> pb.RouterHoldings:
        return holdings(self._core)


def holdings(core: RouterCore) -> pb.RouterHoldings:
    leases = core.leases
    live = leases.live()
    return pb.RouterHoldings(
        router_id=core.router_id, inflight_requests=core.inflight,
        request_ids=sorted(core.admission.live_ids.elements()),
        attempt_ids=[lease.attempt_id for lease in live],
        pending_aborts=core.num_pending_aborts,
        open_channels=core.pool.num_channels,
        lease_keys=sorted(lease.key for lease in live if lease.key),
        unwritten_leases=leases.num_unwritten, prompts_in_flight=core.num_prompts_in_flight)


async def start_debug_server(core: RouterCore, host: str, port: int,
                             api_key: str | None = None) -> tuple[grpc.aio.Server, str]:
    """The RouterDebug service alone on ``host:port`` (0: any), requiring ``api_key`` when
    given; (server, "host:port"). ``RuntimeError`` when the port cannot be bound."""
    interceptors = [] if api_key is None else [api_key_interceptor(api_key)]
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),), interceptors=interceptors)
    pb_grpc.add_RouterDebugServicer_to_server(RouterDebugServicer(core), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port} (port in use?)")
    await server.start()
    return server, f"{host}:{bound}"
