"""Calls to an authenticated internal API from tests: a blocking channel whose every call
carries the cluster token (the first of a rotating pair), as the router's calls do."""

from __future__ import annotations

import collections
from typing import Any

import grpc

from cluster.token import TOKEN_METADATA, parse_tokens


class WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``metadata`` to every call of a (blocking) channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return _CallDetails(details.method, details.timeout,
                            [*(details.metadata or ()), *self._metadata], details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata",
                                                           "credentials", "wait_for_ready",
                                                           "compression")),
                   grpc.ClientCallDetails):
    pass


def with_token(channel: grpc.Channel, token_text: str | None) -> grpc.Channel:
    """``channel``, its calls carrying the first token of ``token_text`` (None: as it is)."""
    if not token_text:
        return channel
    token = parse_tokens(token_text).current
    return grpc.intercept_channel(channel, WithMetadata(((TOKEN_METADATA, token),)))
