"""The router's protocol-agnostic core: one client request from validation to its last
chunk. The two API edges — gRPC (``router.service``) and HTTP (``router.http``) — turn
their own messages into a ``ClientRequest``, call ``Generations.start`` and relay
``Generation.chunks``; everything else is shared: validation, admission (budgets and the
FIFO queue, ``router.admission``), the request lifecycle through the workers
(``router.handoff``), bounded buffering towards a slow client, and cancellation.

Order of business, each step failing fast with its status (``InvalidRequest`` for
validation, else ``RouteError``): deadline already passed (DEADLINE_EXCEEDED) → the
budgets, checked against a cheap upper bound of the prompt's tokens before anything is
tokenized (RESOURCE_EXHAUSTED) → validation and tokenization (INVALID_ARGUMENT) → workers
known and big enough (UNAVAILABLE / INVALID_ARGUMENT) → admitted (RESOURCE_EXHAUSTED over
a budget; a client request id already in flight is served too: every attempt has its own
id on the workers) → queued until a decode worker
takes it (DEADLINE_EXCEEDED if its deadline passes first) → the handoff streams.

Buffering: the handoff's chunks are pumped into a queue of at most ``max_buffered_chunks``
while the edge writes them to its client; when a client falls that far behind, its
request is cancelled on every worker, its admission released and the chunks not yet
written dropped: the client's next read gets RESOURCE_EXHAUSTED ("client too slow"). A
slow reader never holds the router's memory, the workers or the decode batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import tokenizers

from cluster.leases import LeaseKeeper, new_router_id
from router.admission import Admission, Ticket
from router.config import AdmissionConfig, HandoffConfig
from router.errors import RouteError
from router.handoff import Handoff
from router.metrics import RouterMetrics
from router.outputs import OutputChunk
from router.trace import Trace
from router.validation import (
    ClientRequest,
    InvalidRequest,
    ModelLimits,
    ValidRequest,
    validate,
)
from router.workers import WorkerPool

logger = logging.getLogger(__name__)

TOKENIZE_IN_THREAD_CHARS = 4096  # longer prompts are tokenized off the event loop


def token_bound(request: ClientRequest, limits: ModelLimits) -> int:
    """An upper bound of the prompt's tokens, without tokenizing (a byte-level BPE makes
    at most one token per byte, plus a few special ones)."""
    if request.token_ids is not None:
        return len(request.token_ids)
    return min(len((request.text or "").encode("utf-8", "replace")) + 4, limits.context_length)


class _Record:
    """What one request's metrics need, measured where its chunks leave the router."""

    def __init__(self, metrics: RouterMetrics, received_at: float) -> None:
        self.metrics = metrics
        self.received_at = received_at
        self.last_sent: float | None = None
        self.last: OutputChunk | None = None
        self.status = "CANCELLED"  # unless it ends otherwise: the client left

    def sent(self, chunk: OutputChunk) -> None:
        now = time.monotonic()
        if self.last_sent is None:
            self.metrics.ttft.observe(now - self.received_at)
        else:
            self.metrics.itl.observe(now - self.last_sent)
        self.last_sent, self.last = now, chunk

    def done(self, ticket: Ticket) -> None:
        m = self.metrics
        if ticket.placed_at is not None:
            m.queue.observe(ticket.queue_s)
        finish = self.last.finish_reason if self.last is not None else None
        m.requests.labels(self.status, finish or "").inc()
        if self.status == "OK":
            m.e2e.observe(time.monotonic() - self.received_at)
        usage = self.last.usage if self.last is not None else None
        if usage is not None:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.generation_tokens.inc(usage.completion_tokens)
            m.cached_tokens.inc(usage.cached_tokens)


@dataclass
class _End:
    """The pump's last item: how the handoff ended (``error`` None: cleanly)."""

    error: BaseException | None = None


class Generation:
    """One admitted request; iterate ``chunks()`` once (it ends by leaving admission)."""

    def __init__(self, owner: Generations, request: ValidRequest, ticket: Ticket,
                 deadline: float, received_at: float) -> None:
        self.request = request
        self.ticket = ticket
        self.deadline = deadline
        self.received_at = received_at
        self.trace = Trace(received_at)  # where its time went (router.trace)
        self.trace.mark("admitted")
        self._owner = owner

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def chunks(self) -> AsyncGenerator[OutputChunk, None]:
        """The request's chunks; raises ``RouteError``. Leaving early (client gone)
        cancels the request on every worker."""
        record = _Record(self._owner.metrics, self.received_at)
        pump: asyncio.Task[None] | None = None
        try:  # from here on, however it ends, the request leaves admission
            try:
                handoff = self._owner.handoff(self.request, self.ticket, self.deadline,
                                              self.trace)
            except RouteError as exc:  # e.g. no worker known any more
                record.status = exc.code.name
                raise
            queue: asyncio.Queue[tuple[OutputChunk, float] | _End] = asyncio.Queue()
            pump = asyncio.get_running_loop().create_task(self._pump(handoff, queue))
            while True:
                item = await queue.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        record.status = item.error.code.name if isinstance(
                            item.error, RouteError) else "INTERNAL"
                        raise item.error
                    record.status = "OK"
                    return
                chunk, arrived_at = item
                if self.ticket.queued_tokens:
                    self.ticket.first_token()
                record.sent(chunk)
                yield chunk
                self.trace.chunk_written(arrived_at)  # the edge asks for more: written
        finally:
            # leave admission before any await: a second cancel of this task (the client
            # gone, the server stopping) may interrupt the await below
            if pump is not None:
                pump.cancel()
            self.ticket.leave()
            record.done(self.ticket)
            if pump is not None:
                await asyncio.gather(pump, return_exceptions=True)

    async def _pump(self, handoff: Handoff,
                    queue: asyncio.Queue[tuple[OutputChunk, float] | _End]) -> None:
        """Move the handoff's chunks into ``queue``; past the bound the client is too slow."""
        limit = self._owner.config.max_buffered_chunks
        try:
            async with aclosing(handoff.stream()) as chunks:
                async for chunk in chunks:
                    if queue.qsize() >= limit:
                        raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"client too slow: {limit} chunks waited unread (the "
                                         "router's limit, --max-buffered-chunks); the request "
                                         "was cancelled")
                    queue.put_nowait((chunk, time.monotonic()))
        except RouteError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and queue.qsize() >= limit:
                while not queue.empty():  # what the client did not read is dropped
                    queue.get_nowait()
                self.ticket.leave()  # the handoff is closed: nothing is held any more
                logger.warning("cancelled: %s", exc.message,
                               extra={"request_id": self.request_id})
            queue.put_nowait(_End(exc))
        else:
            queue.put_nowait(_End())


class Generations:
    """Starts ``Generation``s for one model over a ``WorkerPool`` (see module doc)."""

    def __init__(self, pool: WorkerPool, limits: ModelLimits, tokenizer: tokenizers.Tokenizer,
                 *, handoff: HandoffConfig, admission: AdmissionConfig,
                 metrics: RouterMetrics | None = None, leases: LeaseKeeper | None = None
                 ) -> None:
        self.pool = pool
        self.limits = limits
        self.config = admission
        self.metrics = metrics or RouterMetrics()
        self.admission = Admission(admission.max_inflight, admission.max_queued_tokens)
        self._tokenizer = tokenizer
        self._handoff = handoff
        # unique per attempt within this router, random across routers; never 0
        self._transfer_ids: Iterator[int] = itertools.count((secrets.randbits(40) << 16) + 1)
        self._prefill_turns: Iterator[int] = itertools.count()  # round-robin routing
        self._background: set[asyncio.Future[object]] = set()
        # every attempt's id and lease (no store: ids only, no lease in Redis)
        self.leases = leases or LeaseKeeper(None, new_router_id(), handoff.lease_ttl_s)
        self.draining = False  # set by the server's stop: new requests get UNAVAILABLE

    async def start(self, client: ClientRequest, timeout_s: float | None) -> Generation:
        """Validate and admit ``client`` (see module doc); its deadline is ``timeout_s``
        from now (None: the router's default)."""
        received_at = time.monotonic()
        try:
            if self.draining:
                raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                 "the router is shutting down; retry on another router",
                                 "draining")
            if timeout_s is not None and timeout_s <= 0:
                raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "the deadline passed before the request was admitted", "deadline")
            deadline = received_at + (self.config.default_timeout_s if timeout_s is None
                                      else timeout_s)
            self.admission.check(token_bound(client, self.limits))
            request = await self._validate(client)
            self._check_fits(request)
            ticket = self.admission.enter(request.request_id, request.num_prompt_tokens)
        except RouteError as exc:
            self.metrics.rejections.labels(exc.limit or exc.code.name.lower()).inc()
            raise
        except InvalidRequest:
            self.metrics.rejections.labels("invalid").inc()
            raise
        return Generation(self, request, ticket, deadline, received_at)

    async def _validate(self, client: ClientRequest) -> ValidRequest:
        if client.text is not None and len(client.text) > TOKENIZE_IN_THREAD_CHARS:
            return await asyncio.to_thread(validate, client, self.limits, self._tokenizer)
        return validate(client, self.limits, self._tokenizer)

    def _check_fits(self, request: ValidRequest) -> None:
        layout = self.pool.layout()
        if layout is None:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is registered")
        need, largest = request.num_blocks(layout.block_size), self.pool.max_decode_blocks()
        if largest and need > largest:
            raise RouteError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"prompt + max_tokens needs {need} KV blocks of "
                             f"{layout.block_size} tokens; the largest decode worker holds "
                             f"{largest}")

    def handoff(self, request: ValidRequest, ticket: Ticket, deadline: float,
                trace: Trace | None = None) -> Handoff:
        return Handoff(self.pool, request, ticket, deadline=deadline, config=self._handoff,
                       transfer_ids=self._transfer_ids, background=self._keep,
                       metrics=self.metrics, leases=self.leases, trace=trace,
                       turns=self._prefill_turns)

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    @property
    def num_pending_aborts(self) -> int:
        """Worker Aborts sent in the background and not answered yet."""
        return len(self._background)

    def _keep(self, future: asyncio.Future[object]) -> None:
        self._background.add(future)
        future.add_done_callback(self._background.discard)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` until no request is in flight; whether none is."""
        deadline = time.monotonic() + timeout_s
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.inflight

    async def drain_background(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded) for the pending worker aborts."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)
