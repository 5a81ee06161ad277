"""``ServedRequest``: one admitted request on its way to the client — the handoff's chunks
pumped into a bounded buffer the API edge reads, and what its metrics need.

Buffering: the handoff's chunks are pumped into a queue of at most ``max_buffered_chunks``
while the edge writes them to its client; when a client falls that far behind, its
request is cancelled on every worker, its admission released and the chunks not yet
written dropped: the client's next read gets RESOURCE_EXHAUSTED ("client too slow"). A
slow reader never holds the router's memory, the workers or the decode batch. Chunks that
wait when the edge asks for the next go to it as one (``merge_chunks``): a client, or a
router loop, that fell behind gets fewer, larger messages instead of a backlog of one per
token (the decode worker does the same towards the router).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from router.admission import Ticket
from router.errors import RouteError
from router.lifecycle.handoff import Handoff
from router.metrics import RouterMetrics
from router.outputs import OutputChunk, merge_chunks
from router.trace import Trace
from router.validation import ValidRequest

logger = logging.getLogger(__name__)


class _Record:
    """What one request's metrics need, measured where its chunks leave the router. A
    later choice of n > 1 (not ``primary``) adds its tokens and gaps only: the request,
    its prompt, its time to first token and its latency are choice 0's."""

    def __init__(self, metrics: RouterMetrics, received_at: float, primary: bool = True
                 ) -> None:
        self.metrics = metrics
        self.received_at = received_at
        self.primary = primary
        self.last_sent: float | None = None
        self.last: OutputChunk | None = None
        self.status = "CANCELLED"  # unless it ends otherwise: the client left

    def sent(self, chunk: OutputChunk) -> None:
        now = time.monotonic()
        if self.last_sent is None:
            if self.primary:
                self.metrics.ttft.observe(now - self.received_at)
        else:
            self.metrics.itl.observe(now - self.last_sent)
        self.last_sent, self.last = now, chunk

    def done(self, ticket: Ticket) -> None:
        m = self.metrics
        usage = self.last.usage if self.last is not None else None
        if usage is not None:
            m.generation_tokens.inc(usage.completion_tokens)
        if not self.primary:
            return
        if ticket.placed_at is not None:
            m.queue.observe(ticket.queue_s)
        finish = self.last.finish_reason if self.last is not None else None
        m.requests.labels(self.status, finish or "").inc()
        if self.status == "OK":
            m.e2e.observe(time.monotonic() - self.received_at)
        if usage is not None:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.cached_tokens.inc(usage.cached_tokens)


@dataclass
class _End:
    """The pump's last item: how the handoff ended (``error`` None: cleanly)."""

    error: BaseException | None = None


def _merge_waiting(item: tuple[OutputChunk, float],
                   queue: asyncio.Queue[tuple[OutputChunk, float] | _End]
                   ) -> tuple[tuple[OutputChunk, float], tuple[OutputChunk, float] | _End | None]:
    """``item`` and the chunks of its choice already waiting behind it, as one chunk (one
    message to a client that fell behind, instead of one per token); and the item taken
    that could not join it (the end, another choice's chunk), if any."""
    first, arrived_at = item
    chunks, taken = [first], None
    while chunks[-1].finish_reason is None and not queue.empty():
        nxt = queue.get_nowait()
        if isinstance(nxt, _End) or nxt[0].index != first.index:
            taken = nxt
            break
        chunks.append(nxt[0])
    return (merge_chunks(chunks), arrived_at), taken


class ServedRequest:
    """One admitted request; iterate ``chunks()`` once (it ends by leaving admission).
    ``make_handoff(trace)`` builds its handoff when the first chunk is asked for; at most
    ``max_buffered_chunks`` chunks wait for the client."""

    def __init__(self, request: ValidRequest, ticket: Ticket, deadline: float,
                 received_at: float, make_handoff: Callable[[Trace], Handoff], *,
                 metrics: RouterMetrics, max_buffered_chunks: int,
                 live: set[ServedRequest] | None = None, choice: int = 0) -> None:
        """``live``: the router's set of requests being served (this one is in it while
        its ``chunks()`` runs), for ``end``; ``choice``: its index among the request's
        choices (n > 1: only choice 0 counts as a request in the metrics)."""
        self.request = request
        self.ticket = ticket
        self.deadline = deadline
        self.received_at = received_at
        self.trace = Trace(received_at)  # where its time went (router.trace)
        self.trace.mark("admitted")
        self._metrics = metrics
        self._max_buffered_chunks = max_buffered_chunks
        self._make_handoff = make_handoff
        self._live = live
        self._choice = choice
        self._queue: asyncio.Queue[tuple[OutputChunk, float] | _End] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._last_queued = False  # the chunk with the finish reason is in the queue

    @property
    def request_id(self) -> str:
        """The client's request id (not unique: clients may reuse it)."""
        return self.request.request_id

    async def chunks(self) -> AsyncGenerator[OutputChunk, None]:
        """The request's chunks; raises ``RouteError``. Leaving early (client gone)
        cancels the request on every worker."""
        record = _Record(self._metrics, self.received_at, primary=not self._choice)
        pump: asyncio.Task[None] | None = None
        try:  # from here on, however it ends, the request leaves admission
            try:
                handoff = self._make_handoff(self.trace)
            except RouteError as exc:  # e.g. no worker known any more
                record.status = exc.code.name
                raise
            queue: asyncio.Queue[tuple[OutputChunk, float] | _End] = asyncio.Queue()
            pump = asyncio.get_running_loop().create_task(self._pump_chunks(handoff, queue))
            self._queue, self._pump = queue, pump
            if self._live is not None:
                self._live.add(self)
            held: tuple[OutputChunk, float] | _End | None = None  # taken, not yet merged
            while True:
                item, held = held or await queue.get(), None
                if not isinstance(item, _End):  # the client fell behind: merge what waits
                    item, held = _merge_waiting(item, queue)
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
            if self._live is not None:
                self._live.discard(self)
            self.ticket.leave()
            record.done(self.ticket)
            if pump is not None:
                await asyncio.gather(pump, return_exceptions=True)

    def end(self, error: RouteError) -> None:
        """Ends the request now (the router is stopping): its workers are released, its
        client gets the chunks already buffered, then ``error``."""
        if self._pump is None or self._queue is None or self._pump.done() or self._last_queued:
            return  # done, or whole but for the handoff's cleanup: the client gets it all
        self._pump.cancel()
        self._queue.put_nowait(_End(error))

    async def _pump_chunks(self, handoff: Handoff,
                    queue: asyncio.Queue[tuple[OutputChunk, float] | _End]) -> None:
        """Move the handoff's chunks into ``queue``; past the bound the client is too slow."""
        limit = self._max_buffered_chunks
        try:
            async with aclosing(handoff.stream()) as chunks:
                async for chunk in chunks:
                    if queue.qsize() >= limit:
                        raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"client too slow: {limit} chunks waited unread (the "
                                         "router's limit, --max-buffered-chunks); the request "
                                         "was cancelled")
                    queue.put_nowait((chunk, time.monotonic()))
                    self._last_queued = self._last_queued or chunk.finish_reason is not None
        except RouteError as exc:
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and queue.qsize() >= limit:
                while not queue.empty():  # what the client did not read is dropped
                    queue.get_nowait()
                self.ticket.leave()  # the handoff is closed: nothing is held any more
                logger.warning("cancelled: %s", exc.message,
                               extra={"request_id": self.request_id})
            elif exc.detail:  # what the client is not told: which worker, what it said
                logger.warning("failed: %s %s (%s)", exc.code.name, exc.message, exc.detail,
                               extra={"request_id": self.request_id})
            queue.put_nowait(_End(exc))
        except Exception as exc:  # noqa: BLE001 - never leave the reader waiting
            logger.exception("the handoff failed", extra={"request_id": self.request_id})
            queue.put_nowait(_End(RouteError(grpc.StatusCode.INTERNAL,
                                             f"the router failed: {type(exc).__name__}")))
        else:
            queue.put_nowait(_End())
