"""Metadata authentication of gRPC servers and the cluster token on internal calls.

``RequireMetadata`` is the one server-side check: every call but health checks and
server reflection must carry metadata ``key`` whose value ``accepts``, else it ends with
UNAUTHENTICATED before any handler runs (nothing is echoed or logged). The router's API
key (``router.auth``) and the workers' cluster token (``cluster_token_interceptor``) are
both instances. ``token_call_interceptors`` adds the cluster token to every call of an
asyncio channel (the router's channels to its workers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from cluster.token import TOKEN_METADATA, ClusterToken

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Method prefixes served without credentials (probes and tooling must reach them)."""


class RequireMetadata(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata ``key`` is missing or not accepted (see module doc);
    ``refusal`` is the UNAUTHENTICATED message the caller gets."""

    def __init__(self, key: str, accepts: Callable[[bytes], bool], refusal: str,
                 open_services: tuple[str, ...] = OPEN_SERVICES) -> None:
        self._key = key
        self._accepts = accepts
        self._refusal = refusal
        self._open = open_services

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(self._open):
            return handler
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _refusal(handler, self._refusal)

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata:
            if key == self._key:
                return self._accepts(value.encode() if isinstance(value, str) else bytes(value))
        return False


def cluster_token_interceptor(token: ClusterToken) -> RequireMetadata:
    """A worker's check of the cluster token on every internal call."""
    return RequireMetadata(TOKEN_METADATA, token.accepts,
                           "missing or wrong cluster token: this worker's cluster requires "
                           "--cluster-token-file or $PDSERVE_CLUSTER_TOKEN on every process")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


class _WithToken:
    """Adds the cluster token to a call's metadata."""

    def __init__(self, token: ClusterToken) -> None:
        self._pair = (TOKEN_METADATA, token.current)

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


# two classes: a channel files an interceptor under its first matching kind only
class _TokenOnUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        return await continuation(self._with_token(client_call_details), request)


class _TokenOnStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        return await continuation(self._with_token(client_call_details), request)


def token_call_interceptors(token: ClusterToken | None) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors of a channel to workers: the token on every call (none without)."""
    return [] if token is None else [_TokenOnUnary(token), _TokenOnStream(token)]
