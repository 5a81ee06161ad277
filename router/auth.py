"""API-key authentication of the public API (row 35 of ``../shared/RELIABILITY.md``).

With a key configured, every call except health checks and server reflection must carry
``authorization: Bearer <key>`` metadata; otherwise it ends with UNAUTHENTICATED before
any handler runs. The key is compared in constant time and never logged or echoed.
Without a key, every call is let through (a private loopback cluster needs none).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from router.options import API_KEY_ENV

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
"""Method prefixes served without a key (probes and tooling must reach them)."""


def load_api_key(path: str | None) -> str | None:
    """The key from ``path`` (first line, stripped), else ``$PDSERVE_API_KEY``, else None.

    Raises ``ValueError`` for an unreadable or empty key file (a typo must not silently
    leave the API open)."""
    if path is not None:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
        key = text.splitlines()[0].strip() if text else ""
        if not key:
            raise ValueError(f"the API key file {path} is empty")
        return key
    return os.environ.get(API_KEY_ENV) or None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right key (see the module docstring)."""

    def __init__(self, api_key: str) -> None:
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _refusal(handler)

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata:
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong API key (send 'authorization: Bearer <key>')")

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
