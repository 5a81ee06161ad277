"""The gRPC edge of the router: the ``pdserve.v1.Generation`` handlers over ``RouterCore``.

A thin adapter: ``Generate`` parses the raw request (``router.api``), hands the
``ClientRequest`` and the call's deadline to ``RouterCore.start`` and writes each chunk as
a ``GenerateResponse``; ``InvalidRequest`` becomes INVALID_ARGUMENT and ``RouteError`` its
own status. Responses are written with ``context.write`` from the handler's own task, so a
client cancel or deadline arrives as ``CancelledError`` at an ``await`` here and the
request's cleanup (``ServedRequest.chunks``' exit) runs at once. A client that sends
``pdserve-trace: 1`` gets the request's ``router.trace`` in the ``pdserve-trace`` trailer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc
from google.protobuf.message import DecodeError

from pdserve.v1 import generate_pb2 as pb
from router import api
from router.core import RouterCore
from router.errors import RouteError
from router.trace import TRACE_METADATA
from router.validation import InvalidRequest

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"
REQUEST_ID_METADATA = "pdserve-request-id"


class GenerationService:
    """Serves ``Generate`` and ``GetModelInfo`` over a ``RouterCore``."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core
        self._refusals = RefusalLog()

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; ``Generate`` receives raw bytes (see ``router.api``)."""
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=None,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.get_model_info, request_deserializer=None,
                response_serializer=pb.ModelInfo.SerializeToString),
        })

    async def get_model_info(self, raw: bytes,
                             context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:  # parsed here: a deserializer's exception would reach the client as UNKNOWN
            pb.ModelInfoRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"not a valid pdserve.v1.ModelInfoRequest: {exc}")
        layout = self._core.pool.layout()
        return api.model_info(self._core.limits,
                              layout.block_size if layout is not None else 0)

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            client = api.parse_generate_request(raw)
            served = await self._core.start(client, context.time_remaining())
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        except RouteError as exc:
            self._refusals.note(exc)
            await context.abort(exc.code, exc.message)
            return
        rid = served.request_id
        context.set_trailing_metadata(((REQUEST_ID_METADATA, rid),))
        log = logging.LoggerAdapter(logger, {"request_id": rid})
        start = time.monotonic()
        cursor = self._core.seal.cursor(served.request, served.request.resumed)
        offsets = [0] * served.request.n  # n > 1: each choice's, and no resume tokens
        try:
            async with aclosing(served.chunks()) as chunks:
                async for chunk in chunks:
                    if served.request.n > 1:
                        offset, token = offsets[chunk.index], b""
                        offsets[chunk.index] += len(chunk.token_ids)
                    else:
                        offset = cursor.offset
                        token = cursor.advance(chunk.token_ids)  # none after the last message
                    await context.write(api.to_response(rid, chunk, offset,
                                                        b"" if chunk.finish_reason else token))
            if _wants_trace(context):
                context.set_trailing_metadata(((REQUEST_ID_METADATA, rid),
                                               (TRACE_METADATA, served.trace.to_json())))
        except RouteError as exc:
            log.warning("failed: %s %s", exc.code.name, exc.message)
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            log.info("cancelled by the client (or its deadline) after %.2fs",
                     time.monotonic() - start)
            raise


class RefusalLog:
    """Logs refused requests without a line each: a burst of thousands refused at admission
    must not cost the event loop a log line apiece. The first refusal of a kind is logged at
    once; later ones are counted and summed up at most every ``every_s`` seconds."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.every_s = every_s
        self._counts: dict[str, int] = {}
        self._logged_at = 0.0

    def note(self, exc: RouteError) -> None:
        key = exc.limit or exc.code.name
        first = key not in self._counts
        self._counts[key] = self._counts.get(key, 0) + 1
        now = time.monotonic()
        if first:
            logger.info("refused: %s %s", exc.code.name, exc.message)
        elif now - self._logged_at >= self.every_s:
            summary = ", ".join(f"{n} {k}" for k, n in sorted(self._counts.items()))
            logger.info("refused since the last summary: %s", summary)
            self._counts = {}
        else:
            return
        self._logged_at = now


def _wants_trace(context: grpc.aio.ServicerContext) -> bool:
    """The client sent ``pdserve-trace: 1`` (it gets ``router.trace`` in the trailer)."""
    return any(key == TRACE_METADATA and value == "1"
               for key, value in context.invocation_metadata() or ())
