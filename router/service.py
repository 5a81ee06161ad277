"""The ``pdserve.v1.Generation`` handlers: validation, admission, the handoff, the stream.

``GenerationService.generate`` runs as a gRPC asyncio handler. Order of business for one
call, each step failing fast with its status: parse + validate (INVALID_ARGUMENT) →
deadline already passed (DEADLINE_EXCEEDED) → request id already in flight
(INVALID_ARGUMENT) → in-flight and queued-token budgets (RESOURCE_EXHAUSTED) → workers
known and big enough (UNAVAILABLE / INVALID_ARGUMENT) → ``Handoff`` streams.
Responses are written with ``context.write`` from the handler's own task, so a client
cancel or deadline arrives as ``CancelledError`` at an ``await`` in this call's code and
the handoff's cleanup runs at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Iterator
from contextlib import aclosing

import grpc
import tokenizers

from pdserve.v1 import generate_pb2 as pb
from router import api
from router.config import HandoffConfig
from router.handoff import Handoff, RouteError
from router.validation import InvalidRequest, ModelLimits, ValidRequest, validate
from router.workers import WorkerPool

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"
REQUEST_ID_METADATA = "pdserve-request-id"


class GenerationService:
    """Serves ``Generate`` and ``GetModelInfo`` for one model over a ``WorkerPool``."""

    def __init__(self, pool: WorkerPool, limits: ModelLimits, tokenizer: tokenizers.Tokenizer,
                 *, handoff: HandoffConfig, max_inflight: int, default_timeout_s: float,
                 max_queued_tokens: int | None = None) -> None:
        self._pool = pool
        self._limits = limits
        self._tokenizer = tokenizer
        self._handoff = handoff
        self._max_inflight = max_inflight
        self._default_timeout_s = default_timeout_s
        self._inflight = 0
        self._live_ids: set[str] = set()  # request ids in flight here
        self._queued_tokens = 0  # prompt tokens of requests before their first token
        self._max_queued_tokens = max_queued_tokens
        # unique per attempt within this router, random across routers; never 0
        self._transfer_ids: Iterator[int] = itertools.count((secrets.randbits(40) << 16) + 1)
        self._background: set[asyncio.Future[object]] = set()

    @property
    def inflight(self) -> int:
        return self._inflight

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; ``Generate`` receives raw bytes (see ``router.api``)."""
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=None,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self.get_model_info, request_deserializer=pb.ModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString),
        })

    async def get_model_info(self, request: pb.ModelInfoRequest,
                             context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        layout = self._pool.layout()
        return api.model_info(self._limits, layout.block_size if layout is not None else 0)

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            request = validate(api.parse_generate_request(raw), self._limits, self._tokenizer)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        context.set_trailing_metadata(((REQUEST_ID_METADATA, request.request_id),))
        log = logging.LoggerAdapter(logger, {"request_id": request.request_id})
        try:
            handoff = self._admit(request, context)
        except RouteError as exc:
            log.info("refused: %s %s", exc.code.name, exc.message)
            await context.abort(exc.code, exc.message)
            return
        self._inflight += 1
        self._live_ids.add(request.request_id)
        queued = request.num_prompt_tokens  # until its first token
        self._queued_tokens += queued
        start = time.monotonic()
        try:
            async with aclosing(handoff.stream()) as chunks:
                async for chunk in chunks:
                    self._queued_tokens -= queued
                    queued = 0
                    await context.write(api.to_response(request.request_id, chunk))
        except RouteError as exc:
            log.warning("failed: %s %s", exc.code.name, exc.message)
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            log.info("cancelled by the client (or its deadline) after %.2fs",
                     time.monotonic() - start)
            raise
        finally:
            self._inflight -= 1
            self._queued_tokens -= queued
            self._live_ids.discard(request.request_id)

    def _admit(self, request: ValidRequest, context: grpc.aio.ServicerContext) -> Handoff:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before "
                             "the request was admitted")
        if request.request_id in self._live_ids:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"request_id {request.request_id!r} is already in flight; "
                             "request ids must be unique")
        if self._inflight >= self._max_inflight:
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self._inflight} requests in flight, the router's limit "
                             f"(--max-inflight {self._max_inflight}); retry later")
        limit = self._max_queued_tokens
        if limit is not None and self._queued_tokens and \
                self._queued_tokens + request.num_prompt_tokens > limit:
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self._queued_tokens} prompt tokens wait for their first token; "
                             f"{request.num_prompt_tokens} more would pass the router's limit "
                             f"(--max-queued-tokens {limit}); retry later")
        layout = self._pool.layout()
        if layout is None:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is registered")
        need, largest = request.num_blocks(layout.block_size), self._pool.max_decode_blocks()
        if largest and need > largest:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"prompt + max_tokens needs {need} KV blocks of "
                             f"{layout.block_size} tokens; the largest decode worker holds "
                             f"{largest}")
        timeout_s = self._default_timeout_s if remaining is None else remaining
        return Handoff(self._pool, request, deadline=time.monotonic() + timeout_s,
                       config=self._handoff, transfer_ids=self._transfer_ids,
                       background=self._keep)

    def _keep(self, future: asyncio.Future[object]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    async def drain_background(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded) for the pending worker aborts."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)
