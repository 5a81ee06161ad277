"""The router's one failure type: what status a client gets, and why (torch-free)."""

from __future__ import annotations

import grpc


class RouteError(Exception):
    """The request failed; ``code`` is the status the client gets (a ``grpc.StatusCode``,
    which the HTTP API maps to its own codes), ``message`` says why, ``limit`` names the
    admission limit that refused it (for metrics; "" otherwise).

    ``message`` is what the client sees: it never names a worker, an address or a worker's
    own error text. Those go in ``detail`` (the router's log of the request, "" if none)."""

    def __init__(self, code: grpc.StatusCode, message: str, limit: str = "",
                 detail: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.limit = limit
        self.detail = detail
