"""One request's trip through the cluster: Reserve, then Prefill and Generate, with retries.

``Handoff.stream()`` is the router's state machine for DESIGN.md's request lifecycle:

1. Reserve KV blocks on a decode worker (least busy first; a refusal moves on to the next
   worker; all refusing → RESOURCE_EXHAUSTED; none reachable → UNAVAILABLE).
2. Prefill on a prefill worker in rendezvous order of the prompt's affinity key (bounded
   load; or in turn, with ``prefill_routing`` "round-robin"), naming the reservation's KV
   target; it pushes the KV and the first token.
3. Generate on the decode worker, opened together with the Prefill, and relay its
   chunks: the first leaves once the KV (with the first token) has arrived there, without
   waiting for the Prefill's reply. Until that first chunk a failed Prefill fails the
   attempt as before.

With ``local_prefill`` "always" (colocated mode), or "fallback" once no prefill worker
is left for the request, an attempt is one ``GenerateLocal`` on the decode worker
instead: it prefills there and streams, with the same retries and cleanup.

Before the first token reaches the client, a failure of a worker (unreachable, KV
transfer failed or corrupt, worker draining) aborts the attempt on both workers and
starts a new one with a new transfer id, excluding the failed worker, up to
``max_attempts``; then UNAVAILABLE. After the first token nothing is retried (the client
has seen tokens): UNAVAILABLE naming how many tokens were streamed. The client's
deadline is handed to every worker call; a passed deadline is DEADLINE_EXCEEDED.

The calls themselves (protobuf, stubs) are ``router.worker_calls``'s, and so is the one
reading of a failed call (``classify``: retry elsewhere, the id already exists, the
deadline passed, or the worker refused what the router sent); this module is the state
machine only.

Attempts and leases: every Reserve (and every local prefill) starts a new attempt with
its own attempt id and lease (``cluster.leases.LeaseKeeper``: written to Redis, renewed
while the attempt lives, deleted when it ends); the Prefill and Generate that follow name
the same attempt, and so does every Abort. Workers key what they hold by attempt id, so
nothing sent for one attempt — a late or timed-out Abort, a late end of a call — can
touch another attempt of the same client request id (a retry, a resubmission, another
router's request under the same id). A worker that holds something for an attempt whose
lease is gone (this router died) frees it within the lease's TTL.

Ownership: the workers own their blocks. Whenever an attempt ends other than by a clean
finish — error, retry, client cancel (``GeneratorExit``/``CancelledError`` reaching the
generator) — its worker calls are cancelled and ``Abort(attempt_id)`` (idempotent) goes
to the decode worker, and to the prefill worker if its Prefill had not returned, from a
background task, so cleanup happens even while the caller is being cancelled; before a
retry the decode Abort is awaited (bounded) so the retry finds the blocks free. Then its
lease is deleted: a worker that missed the Abort frees the attempt within the TTL. After
a clean finish the decode worker has freed everything and the prefill worker unpins on
the decode side's acknowledgement; nothing more is sent.

Test-only pause points (``cluster.pause_points``): ``router.queued`` before a request
waits its turn, ``router.before_prefill`` once its reservation is held,
``router.before_generate`` once its Prefill is under way (the Generate stream not opened).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from cluster import pause_points
from cluster.leases import Lease, LeaseKeeper
from engine.kvcache.block_hash import compute_block_hashes
from router.admission import Ticket
from router.config import HandoffConfig
from router.errors import RouteError
from router.metrics import RouterMetrics
from router.outputs import OutputChunk
from router.routing import DecodeCandidate, affinity_key, pick_prefill, rank_decode, round_robin
from router.trace import Trace
from router.validation import ValidRequest
from router.worker_calls import (
    CallFailure,
    Failure,
    KVTarget,
    Prefilled,
    WorkerCalls,
    chunks,
    classify,
)
from router.workers import WorkerPool

logger = logging.getLogger(__name__)

# how long a finished stream waits for its Prefill's reply (normally back already: the
# prefill worker answers once the decode side acknowledged the KV) before letting it go
PREFILL_SETTLE_S = 1.0
# how long a Generate stream that failed before its first chunk waits for the Prefill's
# own failure, which says whose fault a failed transfer was
PREFILL_VERDICT_S = 2.0


class _Retry(Exception):
    """This attempt failed before any token reached the client; another may succeed.
    ``cause``: reserve, prefill, generate, worker_left, health or no_prefill (metrics)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class _Busy(Exception):
    """A worker answered "busy" (RESOURCE_EXHAUSTED) before any token reached the client:
    wait for capacity and try again; the worker is not suspected, the attempt not spent."""


@dataclass
class _Attempt:
    number: int
    lease: Lease  # its id (what every worker call names) and its lease in Redis
    decode_id: str
    transfer_id: int  # 0 when prefilled locally (no transfer)
    target: KVTarget | None  # None when prefilled locally
    prefill_id: str | None = None
    calls: list[grpc.aio.Call] = field(default_factory=list)
    finished: bool = False
    decode_aborted: bool = False


class Handoff:
    """Drives one validated request to completion; iterate ``stream()`` once."""

    def __init__(self, pool: WorkerPool, request: ValidRequest, ticket: Ticket, *,
                 deadline: float, config: HandoffConfig, transfer_ids: Iterator[int],
                 background: Callable[[asyncio.Future[object]], None],
                 metrics: RouterMetrics, leases: LeaseKeeper,
                 clock: Callable[[], float] = time.monotonic,
                 trace: Trace | None = None, turns: Iterator[int] | None = None) -> None:
        self._pool = pool
        self._metrics = metrics
        self._req = request
        self._ticket = ticket
        self._admission = ticket.admission
        self._leases = leases
        self._calls = WorkerCalls(pool, request, leases.ttl_ms)
        self._deadline = deadline
        self._config = config
        self._transfer_ids = transfer_ids
        self._background = background
        self._clock = clock
        self._excluded: set[str] = set()  # workers that failed this request
        self._log = logging.LoggerAdapter(logger, {"request_id": request.request_id})
        layout = pool.layout()
        if layout is None:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is registered")
        self._block_size = layout.block_size
        self._hash_seed = layout.hash_seed
        self._key: bytes | None = None  # the prefill affinity key, computed on first use
        self._trace = trace or Trace(clock(), clock)  # marks only (router.trace)
        self._turns = turns  # round-robin prefill routing: this router's turn counter
        self._turn: int | None = None

    async def stream(self) -> AsyncGenerator[OutputChunk, None]:
        """The request's output chunks; raises ``RouteError`` on failure. The first
        attempt waits its turn in the router's queue (``Ticket.turn``) while no decode
        worker can take it; later attempts (after a failure) go ahead of the queue."""
        failures: list[str] = []
        number = 1
        while number <= self._config.max_attempts:
            attempt = await self._place(number)
            try:
                if attempt.target is not None and pause_points.enabled():
                    await pause_points.apause("router.before_prefill",
                                              request_id=self._req.request_id,
                                              attempt_id=attempt.lease.attempt_id)
                with self._pool.busy(attempt.decode_id):
                    chunks_of = (self._relay(attempt, self._start_local(attempt))
                                 if attempt.target is None else self._prefill_and_relay(attempt))
                    async with aclosing(chunks_of) as relayed:
                        async for chunk in relayed:
                            yield chunk
                    return
            except _Busy as busy:  # not the worker's fault: wait, then the same attempt again
                self._metrics.retries.labels("busy").inc()
                self._log.info("attempt %d: %s; waiting for capacity", number, busy)
                await self._abort_decode_now(attempt)
                await self._admission.capacity_changed(self._deadline)
            except _Retry as retry:
                self._metrics.retries.labels(retry.cause).inc()
                failures.append(str(retry))
                self._log.warning("attempt %d failed, %s: %s", number,
                                  "retrying" if number < self._config.max_attempts
                                  else "giving up", retry)
                if attempt.decode_id not in self._excluded:  # the next Reserve may go there
                    await self._abort_decode_now(attempt)
                number += 1
            finally:
                self._end(attempt)
        raise RouteError(grpc.StatusCode.UNAVAILABLE,
                         f"the workers failed {len(failures)} times before the first token: "
                         + "; ".join(failures))

    async def _place(self, number: int) -> _Attempt:
        """A decode worker for this attempt (a reservation, or local prefill); the first
        placement of the request waits its turn in the router's queue."""
        self._metrics.attempts.inc()
        self._trace.attempts += 1
        if self._ticket.placed_at is not None:
            return self._local_attempt(number) if self._prefill_locally() \
                else await self._reserve(number)
        if pause_points.enabled():
            await pause_points.apause("router.queued", request_id=self._req.request_id)
        async with self._ticket.turn(self._deadline):
            self._trace.mark("turn")
            attempt = self._local_attempt(number) if self._prefill_locally() \
                else await self._reserve(number)
        self._ticket.placed()
        return attempt

    # ----------------------------------------------------------------- steps

    def _affinity_key(self) -> bytes:
        """The prompt's prefill affinity key (hashing only the blocks it needs)."""
        if self._key is None:
            head = self._req.prompt_token_ids[:self._config.affinity_blocks * self._block_size]
            hashes = compute_block_hashes(head, self._block_size, seed=self._hash_seed)
            self._key = affinity_key(hashes, self._req.prompt_token_ids,
                                     self._config.affinity_blocks)
        return self._key

    def _decode_order(self) -> list[str]:
        need = self._req.num_blocks(self._block_size)
        candidates = [DecodeCandidate(r.worker_id, self._pool.inflight(r.worker_id),
                                      r.free_kv_blocks, r.total_kv_blocks)
                      for r in self._pool.routable("decode") if r.worker_id not in self._excluded]
        order = rank_decode(candidates, need)
        if not order:
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"no healthy decode worker can hold {need} KV blocks")
        return order

    def _prefill_locally(self) -> bool:
        """Colocated this attempt: always, or (fallback) when no prefill worker is left."""
        mode = self._config.local_prefill
        return mode == "always" or mode == "fallback" and not any(
            r.worker_id not in self._excluded for r in self._pool.routable("prefill"))

    def _local_attempt(self, number: int) -> _Attempt:
        decode_id = self._decode_order()[0]
        self._metrics.routed.labels("decode", decode_id).inc()
        self._log.info("attempt %d: prefilling locally on %s (%s)", number, decode_id,
                       "colocated mode" if self._config.local_prefill == "always"
                       else "no prefill worker left")
        lease = self._leases.open(self._req.request_id)
        self._leases.hold(lease, decode_id)
        return _Attempt(number, lease, decode_id, 0, None)

    async def _reserve(self, number: int) -> _Attempt:
        """A reservation on the first decode worker (least busy first) that has room;
        while every reachable one refuses (no room now, or at its stream limit), wait for
        capacity (until the deadline). UNAVAILABLE when none answers at all."""
        while True:
            attempt, refusals, any_refused = await self._try_reserve(number)
            if attempt is not None:
                return attempt
            if not any_refused:
                raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                 f"no decode worker could reserve "
                                 f"{self._req.num_blocks(self._block_size)} KV blocks: "
                                 + "; ".join(refusals))
            await self._admission.capacity_changed(self._deadline)

    async def _try_reserve(self, number: int) -> tuple[_Attempt | None, list[str], bool]:
        """One pass over the decode workers: (the attempt, or None with why each refused
        and whether any answered "no room now")."""
        refusals: list[str] = []
        any_refused = False  # a worker answered "no room" (vs. none answering at all)
        for decode_id in self._decode_order():
            transfer_id = next(self._transfer_ids)
            self._trace.worker_call()
            lease = self._leases.open(self._req.request_id)  # a new attempt per Reserve
            self._leases.hold(lease, decode_id)
            try:
                call = self._calls.start_reserve(
                    decode_id, lease, transfer_id,
                    self._timeout(self._config.reserve_timeout_s), wait_s=self._timeout())
                # counted by concurrent choices already; cancelled if the worker is hung
                with self._pool.busy(decode_id), self._pool.watched(decode_id, call):
                    reply = WorkerCalls.reserved(await call)
                self._pool.heard_from(decode_id)
            except KeyError:  # left the registry meanwhile
                self._leases.close(lease)
                continue
            except asyncio.CancelledError:
                self._abort_later(decode_id, "decode", lease)  # it may hold a reservation
                self._leases.close(lease)
                _reraise_if_we_are_cancelled()
                self._excluded.add(decode_id)  # the pool took the call back: it is hung
                refusals.append(f"{decode_id}: stopped answering health checks")
                continue
            except grpc.aio.AioRpcError as exc:
                failure = self._failure(exc)
                if failure.kind is Failure.ALREADY_EXISTS:  # not ours to abort
                    self._leases.close(lease)
                    raise self._id_in_use("") from None
                self._abort_later(decode_id, "decode", lease)  # it may hold a reservation
                self._leases.close(lease)
                self._check_deadline(failure)
                if failure.kind is Failure.REFUSED:  # the worker refused what the router sent
                    raise RouteError(grpc.StatusCode.INTERNAL,
                                     f"reserve on {decode_id}: {failure}") from None
                refusals.append(f"{decode_id}: {failure}")
                if failure.kind is Failure.BUSY:
                    any_refused = True
                    continue
                self._worker_failed(decode_id, failure)
                continue
            if reply.accepted:
                self._metrics.routed.labels("decode", decode_id).inc()
                self._log.info("attempt %d (%s): %d blocks reserved on %s (transfer %d)",
                               number, lease.attempt_id, reply.num_blocks, decode_id,
                               transfer_id)
                return (_Attempt(number, lease, decode_id, transfer_id, reply.target),
                        refusals, True)
            self._leases.close(lease)  # refused: nothing is held for it
            refusals.append(f"{decode_id}: {reply.reason}")
            any_refused = True
        return None, refusals, any_refused

    async def _prefill(self, attempt: _Attempt) -> Prefilled:
        """Prefill on the first prefill worker in ``_prefill_order`` (rendezvous order with
        bounded load, or round-robin) that is not busy; while all are, wait for capacity
        (the reservation waits meanwhile)."""
        while True:
            workers = {r.worker_id: self._pool.inflight(r.worker_id) for r in
                       self._pool.routable("prefill") if r.worker_id not in self._excluded}
            order = self._prefill_order(workers)
            if not order:
                if self._config.local_prefill == "fallback":  # the next attempt prefills locally
                    raise _Retry("no prefill worker left", "no_prefill")
                raise RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
            for prefill_id in order:
                reply = await self._prefill_on(attempt, prefill_id)
                if reply is not None:
                    return reply
            self._log.info("every prefill worker is busy; waiting for capacity")
            await self._admission.capacity_changed(self._deadline)

    def _prefill_order(self, workers: dict[str, int]) -> list[str]:
        """Prefill workers to try: by affinity (bounded load), or round-robin."""
        if self._config.prefill_routing == "round-robin":
            if self._turn is None:
                self._turn = next(self._turns) if self._turns is not None else 0
            return round_robin(list(workers), self._turn)
        return pick_prefill(self._affinity_key(), workers, self._config.load_epsilon)

    async def _prefill_on(self, attempt: _Attempt, prefill_id: str) -> Prefilled | None:
        """The Prefill call on ``prefill_id``: its reply, or None when it answered busy."""
        attempt.prefill_id = prefill_id
        self._metrics.routed.labels("prefill", prefill_id).inc()
        assert attempt.target is not None
        self._trace.mark("prefill_started")
        self._leases.hold(attempt.lease, prefill_id)
        try:
            call = self._calls.start_prefill(prefill_id, attempt.lease, attempt.target,
                                             self._timeout())
        except KeyError:
            self._excluded.add(prefill_id)
            raise _Retry(f"prefill worker {prefill_id} left the registry", "worker_left") from None
        attempt.calls.append(call)
        try:
            with self._pool.busy(prefill_id), self._pool.watched(prefill_id, call):
                reply = WorkerCalls.prefilled(await call)
            self._pool.heard_from(prefill_id)
        except asyncio.CancelledError:
            _reraise_if_we_are_cancelled()
            self._excluded.add(prefill_id)
            raise _Retry(f"prefill worker {prefill_id} stopped answering health checks",
                         "health") from None
        except grpc.aio.AioRpcError as exc:
            failure = self._failure(exc)
            self._check_deadline(failure)
            if failure.kind is Failure.BUSY:
                attempt.prefill_id = None  # it took nothing
                return None
            if failure.kind is Failure.ALREADY_EXISTS:  # the worker did not fail
                attempt.prefill_id = None  # the id's holder there is not ours to abort
                raise self._id_in_use(" on a prefill worker") from None
            self._worker_failed(prefill_id, failure)
            why = f"prefill on {prefill_id}: {failure}"
            if failure.kind is Failure.REFUSED:  # the worker refused what the router sent
                raise RouteError(grpc.StatusCode.INTERNAL, why) from None
            raise _Retry(why, "prefill") from None
        attempt.prefill_id = None  # it returned once the decode side acknowledged: done
        self._trace.mark("prefill_returned")
        self._trace.prefill = reply.times
        self._log.info("prefilled on %s (%d of %d prompt tokens cached)", prefill_id,
                       reply.num_cached_tokens, reply.num_prompt_tokens)
        return reply

    async def _prefill_and_relay(self, attempt: _Attempt) -> AsyncGenerator[OutputChunk, None]:
        """Generate opened on the decode worker together with the Prefill: its first chunk
        leaves as soon as the KV has arrived there, not after the Prefill reply's trip
        back and a Generate call behind it. Until that chunk a failed Prefill fails the
        attempt (the stream is cancelled with it); once the stream is done, the Prefill's
        reply is awaited briefly for its timings, then the call is let go."""
        prefill = asyncio.ensure_future(self._prefill(attempt))
        relayed: AsyncGenerator[OutputChunk, None] | None = None
        first: asyncio.Future[OutputChunk | None] | None = None
        try:
            if pause_points.enabled():
                await pause_points.apause("router.before_generate",
                                          request_id=self._req.request_id,
                                          attempt_id=attempt.lease.attempt_id)
            relayed = self._relay(attempt, self._start_generate(attempt))
            first = asyncio.ensure_future(_next(relayed))
            try:
                await asyncio.wait((first, prefill), return_when=asyncio.FIRST_COMPLETED)
                if not first.done():
                    prefill.result()  # raises the Prefill's failure; a reply: the KV is there
                    await asyncio.wait((first,))
            finally:
                if not first.done():
                    first.cancel()
                    await asyncio.wait((first,))
            try:
                chunk = first.result()
            except _Retry:  # e.g. the KV failed its checksum: whose fault the Prefill says
                blame = await self._prefill_failure(prefill)
                if blame is None:
                    raise
                self._excluded.discard(attempt.decode_id)  # the decode worker only reported it
                raise blame from None
            if chunk is not None:
                yield chunk
                async for chunk in relayed:
                    yield chunk
        finally:
            if first is not None and first.done() and not first.cancelled():
                first.exception()  # retrieved: raised above, or superseded by a cancel
            if relayed is not None:
                await relayed.aclose()
            await self._settle(prefill, PREFILL_SETTLE_S if attempt.finished else 0.0)

    async def _prefill_failure(self, prefill: asyncio.Future[Prefilled]
                               ) -> _Retry | RouteError | None:
        """How the Prefill ended, waited for up to ``PREFILL_VERDICT_S`` after the Generate
        stream failed before its first chunk: its failure (which names the prefill worker,
        as when the Prefill fails first), or None (it returned, or has not answered)."""
        if not prefill.done():
            await asyncio.wait((prefill,), timeout=PREFILL_VERDICT_S)
        if not prefill.done() or prefill.cancelled():
            return None
        failure = prefill.exception()
        return failure if isinstance(failure, _Retry | RouteError) else None

    async def _settle(self, prefill: asyncio.Future[Prefilled], wait_s: float) -> None:
        """Let the Prefill task end: waited for up to ``wait_s``, then cancelled, also when
        this task is cancelled meanwhile (``_end`` aborts the attempt on the prefill worker
        if it did not finish cleanly and the call had not returned)."""
        try:
            if not prefill.done() and wait_s > 0:
                await asyncio.wait((prefill,), timeout=wait_s)
        finally:
            if not prefill.done():
                prefill.cancel()
                await asyncio.wait((prefill,))
        if not prefill.cancelled() and prefill.exception() is not None and wait_s > 0:
            self._log.warning("the Prefill call failed after the stream ended: %r",
                              prefill.exception())

    def _start_generate(self, attempt: _Attempt) -> grpc.aio.UnaryStreamCall:
        try:
            self._trace.mark("generate_started")
            call = self._calls.start_generate(attempt.decode_id, attempt.lease, self._timeout())
        except KeyError:  # left the registry meanwhile (its channel is closed)
            raise self._decode_left(attempt) from None
        attempt.calls.append(call)
        return call

    def _start_local(self, attempt: _Attempt) -> grpc.aio.UnaryStreamCall:
        try:
            self._trace.worker_call()
            self._trace.mark("generate_started")
            call = self._calls.start_generate_local(attempt.decode_id, attempt.lease,
                                                    self._timeout())
        except KeyError:
            raise self._decode_left(attempt) from None
        attempt.calls.append(call)
        return call

    def _decode_left(self, attempt: _Attempt) -> _Retry:
        self._excluded.add(attempt.decode_id)
        return _Retry(f"decode worker {attempt.decode_id} left the registry", "worker_left")

    async def _relay(self, attempt: _Attempt, call: grpc.aio.UnaryStreamCall
                     ) -> AsyncGenerator[OutputChunk, None]:
        """The decode worker's stream; a failure before the first token is ``_Retry``,
        after it ``RouteError``."""
        num_streamed = 0
        try:
            with self._pool.watched(attempt.decode_id, call):
                async for chunk in chunks(call):
                    self._pool.heard_from(attempt.decode_id)
                    if chunk.worker_s is not None:  # the first chunk
                        self._trace.mark("first_chunk")
                        self._trace.decode_first_chunk_s = chunk.worker_s
                    num_streamed += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        attempt.finished = True
                    yield chunk
        except asyncio.CancelledError:
            _reraise_if_we_are_cancelled()
            self._excluded.add(attempt.decode_id)
            why = f"decode worker {attempt.decode_id} stopped answering health checks"
            if num_streamed == 0:
                raise _Retry(why, "health") from None
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"{why} after {num_streamed} streamed tokens") from None
        except grpc.aio.AioRpcError as exc:
            failure = self._failure(exc)
            self._check_deadline(failure)
            if num_streamed == 0 and failure.kind is Failure.BUSY:
                raise _Busy(f"{attempt.decode_id} is busy: {failure}") from None
            if num_streamed == 0 and failure.kind is Failure.RETRY:
                self._excluded.add(attempt.decode_id)
                raise _Retry(f"generate on {attempt.decode_id}: {failure}", "generate") from None
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"decode worker {attempt.decode_id} failed after {num_streamed} "
                             f"streamed tokens: {failure}") from None
        if not attempt.finished:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, f"decode worker {attempt.decode_id} "
                             "ended the stream without a finish reason")

    # ----------------------------------------------------------------- helpers

    def _end(self, attempt: _Attempt) -> None:
        """Cancels the attempt's calls and, unless it finished cleanly, aborts it on both
        workers in the background (idempotent there); its lease ends either way."""
        for call in attempt.calls:
            call.cancel()
        if not attempt.finished:
            if not attempt.decode_aborted:
                self._abort_later(attempt.decode_id, "decode", attempt.lease)
            if attempt.prefill_id is not None:
                self._abort_later(attempt.prefill_id, "prefill", attempt.lease)
        self._leases.close(attempt.lease)

    async def _abort_decode_now(self, attempt: _Attempt) -> None:
        """Cancels the attempt's calls and waits (bounded) for the decode worker's Abort,
        so the next attempt finds its blocks free. If this task
        is cancelled meanwhile, ``_end`` sends the Abort again in the background."""
        for call in attempt.calls:
            call.cancel()
        call = self._calls.start_abort(attempt.decode_id, "decode", attempt.lease.attempt_id)
        if call is not None:
            await self._await_abort(call, attempt.decode_id)
        attempt.decode_aborted = True

    def _abort_later(self, worker_id: str, role: str, lease: Lease) -> None:
        """Abort the attempt on the worker in the background (should the Abort not reach
        it, the worker frees the attempt once its lease is gone)."""
        call = self._calls.start_abort(worker_id, role, lease.attempt_id)
        if call is not None:
            self._background(asyncio.ensure_future(self._await_abort(call, worker_id)))

    async def _await_abort(self, call: grpc.aio.UnaryUnaryCall, worker_id: str) -> object:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            self._log.warning("abort on %s failed: %s %s", worker_id, exc.code().name,
                              exc.details())
            return None

    def _timeout(self, cap_s: float | None = None) -> float:
        remaining = self._deadline - self._clock()
        if remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return remaining if cap_s is None else min(remaining, cap_s)

    def _failure(self, exc: grpc.aio.AioRpcError) -> CallFailure:
        return classify(exc, deadline_passed=self._clock() >= self._deadline)

    @staticmethod
    def _check_deadline(failure: CallFailure) -> None:
        if failure.kind is Failure.DEADLINE:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             "the request's deadline passed while the workers were serving it")

    def _id_in_use(self, where: str) -> RouteError:
        """A worker holds this attempt's id already: attempt ids are unique per router and
        random across routers, so this is a bug, not the client's doing."""
        return RouteError(grpc.StatusCode.INTERNAL,
                          f"an attempt id of request {self._req.request_id!r} is already held"
                          f"{where} (attempt ids must be unique)")

    def _worker_failed(self, worker_id: str, failure: CallFailure) -> None:
        self._excluded.add(worker_id)
        if failure.unreachable:
            self._pool.mark_failed(worker_id, str(failure))


async def _next(chunks_of: AsyncGenerator[OutputChunk, None]) -> OutputChunk | None:
    """The next chunk, or None when the stream is over."""
    try:
        return await anext(chunks_of)
    except StopAsyncIteration:
        return None


def _reraise_if_we_are_cancelled() -> None:
    """Inside ``except CancelledError``: re-raise when this task itself is being cancelled
    (client cancel, deadline); return when only the worker call was (``WorkerPool.watched``)."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        raise  # noqa: PLE0704 -- re-raises the CancelledError being handled
