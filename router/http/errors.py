"""HTTP status codes and OpenAI's error body for everything the router can refuse.

Every error leaves the HTTP API as ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's shape; the ``openai`` SDK raises its own exception class per status). The router's
``RouteError`` carries a ``grpc.StatusCode``; ``STATUS`` maps it:

| gRPC status | HTTP | ``openai`` SDK exception |
|---|---|---|
| INVALID_ARGUMENT | 400 | ``BadRequestError`` |
| UNAUTHENTICATED | 401 | ``AuthenticationError`` |
| PERMISSION_DENIED | 403 | ``PermissionDeniedError`` |
| NOT_FOUND (unknown model) | 404 | ``NotFoundError`` |
| RESOURCE_EXHAUSTED | 429 | ``RateLimitError`` |
| UNAVAILABLE | 503 | ``InternalServerError`` |
| DEADLINE_EXCEEDED | 504 | ``InternalServerError`` |
| anything else | 500 | ``InternalServerError`` |

An oversized body is 413. After a stream has started, an error arrives as an SSE ``error``
event with the same body, followed by ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

import grpc

from router.errors import RouteError
from router.validation import InvalidRequest

STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # the client left; nobody reads it
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
    415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    499: "cancelled", 503: "service_unavailable", 504: "timeout",
}


class ApiError(Exception):
    """A request the HTTP API refuses: ``status`` and the fields of OpenAI's error body.

    ``code`` defaults to the gRPC status name in lower case (``invalid_argument``,
    ``resource_exhausted``, ...), so a client sees the same classification on both APIs.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_route_error(cls, exc: RouteError) -> ApiError:
        return cls(STATUS.get(exc.code, 500), exc.message, code=exc.code.name.lower())

    @classmethod
    def from_invalid(cls, exc: InvalidRequest, param: str | None = None) -> ApiError:
        """400 with the router's own validation message (the one gRPC sends too)."""
        return cls(400, str(exc), param=param, code="invalid_argument")

    @classmethod
    def invalid(cls, message: str, param: str | None = None,
                code: str = "invalid_argument") -> ApiError:
        return cls(400, message, param=param, code=code)

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message,
                          "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def as_api_error(exc: BaseException) -> ApiError:
    """Any failure of a request as an ``ApiError`` (unknown ones: 500, message kept)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RouteError):
        return ApiError.from_route_error(exc)
    if isinstance(exc, InvalidRequest):
        return ApiError.from_invalid(exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", code="internal")
