"""The Prefill of an attempt: on the first prefill worker in ``Placement.prefill_order``
that is not busy (while all are, it waits for capacity; the reservation waits
meanwhile), naming the reservation's KV target. It returns once the decode worker
acknowledged the KV and the first token (``Prefilled``). It may go out together with
the attempt's Reserve, naming the target the router expects (``Placement``); the decode
worker's receiver parks KV that arrives before its reservation.

A Prefill that conditional disaggregation may keep local carries the most prompt tokens
it may wait behind (``conditional.queue_limit``), lowered to what this router's view
assumed of that worker's queue (``router.policy.queue_bounds``); a worker with more
refuses it, and the next one in the order is asked (``_prefill_in_order``). When every
worker asked refused it so or was busy, and one at least for its queue, the attempt ends
with ``QueueRefused``: the next prefills on its decode worker.

Failures: a worker that failed is excluded and the attempt is retried (``Retry``); one
that refused what the router sent is INTERNAL (a router bug); no prefill worker left is
UNAVAILABLE, or (``local_prefill`` "fallback", or "always" after a failed move) a retry
that prefills locally.

A planned move pending (``RequestContext.pending_move``, ``cluster.moves``) goes first:
the Prefill goes to the draining decode worker, naming the parked attempt, and that
worker sends the KV it holds. A move refused before anything was sent (the offer
expired, the tokens differ) falls back to the prefill workers within the attempt; one
that failed after (the KV transfer) is retried as a new attempt, which replays.
"""

from __future__ import annotations

import asyncio
import math

import grpc

from cluster.prefill_queue import refused_queue
from router.errors import RouteError
from router.lifecycle.attempt import Attempt
from router.lifecycle.conditional import DEARER, queue_limit
from router.lifecycle.context import RequestContext
from router.lifecycle.outcomes import (
    MoveOffer,
    QueueRefused,
    Retry,
    reraise_if_we_are_cancelled,
)
from router.lifecycle.placement import Placement
from router.policy import predicted_cost
from router.worker_calls import Failure, Prefilled, WorkerCalls

# how long a Generate stream that failed before its first chunk waits for the Prefill's
# own failure, which says whose fault a failed transfer was
PREFILL_VERDICT_S = 2.0
# at most this many workers an attempt asks with their queue bound: a stale view costs that
# many refusals at most, however many workers the cluster runs
MAX_BOUNDED_ASKS = 4
# what a refused move answers: the draining worker sent nothing (replay within the attempt)
MOVE_REFUSALS = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                           grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED})


async def prefill(attempt: Attempt, placement: Placement) -> Prefilled:
    """The attempt's Prefill (see the module docstring)."""
    ctx = attempt.ctx
    move, ctx.pending_move = ctx.pending_move, None
    if move is not None:
        moved = await _move(attempt, move)
        if moved is not None:
            return moved
    while True:
        order = placement.prefill_order(attempt.decode_id)
        if not order:
            if any(r.worker_id == attempt.decode_id for r in ctx.pool.routable("prefill")):
                # the attempt's decode worker switched to prefill: place the request again
                raise Retry(f"decode worker {attempt.decode_id} now prefills", "prefill")
            if ctx.config.local_prefill != "never":  # the next attempt prefills locally
                raise Retry("no prefill worker left", "no_prefill")
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        reply = await _prefill_in_order(attempt, placement, order)
        if reply is not None:
            return reply
        ctx.log.info("every prefill worker is busy; waiting for capacity")
        await ctx.ticket.admission.capacity_changed(ctx.deadline)


async def _prefill_in_order(attempt: Attempt, placement: Placement, order: list[str]
                            ) -> Prefilled | None:
    """The Prefill on the first worker of ``order`` that takes it. Each is asked with a
    queue limit (where conditional disaggregation sets one): the local side
    (``queue_limit``), lowered to its queue bound (``router.policy.queue_bounds``; the
    first ``MAX_BOUNDED_ASKS`` asked only) and, once a worker refused saying what it
    holds, to what still costs less than that one really does (a worker that cannot, even
    idle, is passed over, as is one that would cost more than the decode worker even idle:
    ``conditional.DEARER``). When none took it, those refused holding no more than the
    local side are asked again with that alone, the least cost first. Then None when all
    asked were busy; ``QueueRefused`` when one at least refused for its queue, or none was
    worth asking (the decode worker computes it sooner)."""
    refusals: dict[str, str] = {}  # worker -> its queue refusal's details
    local_side: dict[str, int] = {}
    again: dict[str, float] = {}  # refused within the local side: its cost, as it said
    best = math.inf  # the least cost of a worker that refused, by what it said it holds
    choice, block = placement.prefill_choice, attempt.ctx.block_size
    refused = attempt.ctx.metrics.queue_refusals  # by the limit it was over
    asked = dearer = 0
    for prefill_id in order:
        local = local_side[prefill_id] = queue_limit(placement, attempt.decode_id, prefill_id)
        if local == DEARER:  # even idle, it would take longer than the decode worker
            dearer += 1
            continue
        tokens, speed = placement.prefill_tokens(prefill_id), choice.speeds.get(prefill_id, 1.0)
        limit = min(local, choice.queue_bounds.get(prefill_id, 0) or local) \
            if local and asked < MAX_BOUNDED_ASKS else local
        if local and best < math.inf:
            limit = min(limit, int(best * speed) - tokens + block)
            if limit < 1:
                continue  # dearer than a refused worker even idle
        asked += 1
        reply = await _prefill_on(attempt, prefill_id, tokens, limit, refusals)
        if reply is not None:
            return reply
        if prefill_id in refusals:
            refused.labels("bound" if limit < local else "local").inc()
            if (held := refused_queue(refusals[prefill_id])) is not None:
                best = min(best, cost := predicted_cost(held, tokens, speed))
                if held <= local:
                    again[prefill_id] = cost
    for prefill_id in sorted(again, key=again.__getitem__):
        attempt.ctx.log.info("asking %s again: it holds more prompt tokens than this router "
                             "saw", prefill_id)
        del refusals[prefill_id]  # its answer now stands: busy, as any, waits for capacity
        reply = await _prefill_on(attempt, prefill_id, placement.prefill_tokens(prefill_id),
                                  local_side[prefill_id], refusals)
        if reply is not None:
            return reply
        if prefill_id in refusals:
            refused.labels("local").inc()
    if refusals:
        raise QueueRefused("; ".join(f"prefill worker {w}: {why}" for w, why in refusals.items()))
    if dearer == len(order):
        raise QueueRefused("every prefill worker would take longer than the decode worker, "
                           "even idle", by_router=True)
    return None


async def _prefill_on(attempt: Attempt, prefill_id: str, tokens: int, limit: int = 0,
                      refusals: dict[str, str] | None = None) -> Prefilled | None:
    """The Prefill call on ``prefill_id`` (which computes about ``tokens`` of the prompt):
    its reply, or None when it answered busy, or refused it for having more than
    ``limit`` prompt tokens to compute before it (its details, in ``refusals``)."""
    ctx = attempt.ctx
    assert attempt.target is not None
    ctx.metrics.routed.labels("prefill", prefill_id).inc()
    ctx.trace.mark("prefill_started")
    attempt.prefill_started(prefill_id)
    try:
        call = ctx.calls.start_prefill(prefill_id, attempt.id, attempt.lease, attempt.target,
                                       ctx.timeout(), max_queued_tokens=limit)
    except KeyError:
        attempt.prefill_released()
        ctx.excluded.add(prefill_id)
        raise Retry(f"prefill worker {prefill_id} left the registry", "worker_left") from None
    attempt.track(call)
    try:
        with ctx.pool.busy(prefill_id, tokens), ctx.pool.watched(prefill_id, call):
            reply = WorkerCalls.prefilled(await call)
        ctx.pool.heard_from(prefill_id, reply.prefill_tokens_per_s)
    except asyncio.CancelledError:
        reraise_if_we_are_cancelled()
        ctx.excluded.add(prefill_id)
        raise Retry(f"prefill worker {prefill_id} stopped answering health checks",
                    "health") from None
    except grpc.aio.AioRpcError as exc:
        failure = ctx.failure(exc)
        ctx.check_deadline(failure)
        if failure.kind is Failure.BUSY:
            attempt.prefill_released()  # it took nothing
            return None
        if failure.kind is Failure.QUEUED:
            attempt.prefill_released()  # it took nothing
            if refusals is not None:
                refusals[prefill_id] = failure.details
            return None
        if failure.kind is Failure.ALREADY_EXISTS:  # the worker did not fail
            attempt.prefill_released()  # the id's holder there is not ours to abort
            raise ctx.id_in_use(" on a prefill worker") from None
        # sent with the Reserve: a refused Reserve refuses the KV too (the wait is then
        # cancelled, the attempt ending); only a failure with the reservation held counts
        await attempt.reservation_known()
        ctx.worker_failed(prefill_id, failure)
        why = f"prefill on {prefill_id}: {failure}"
        if failure.kind is Failure.REFUSED:  # the worker refused what the router sent
            raise RouteError(grpc.StatusCode.INTERNAL,
                             "a prefill worker refused the prefill the router sent",
                             detail=why) from None
        raise Retry(why, "prefill") from None
    attempt.prefill_released()  # it returned once the decode side acknowledged: done
    ctx.trace.mark("prefill_returned")
    ctx.trace.prefill = reply.times
    ctx.log.info("prefilled on %s (%d of %d prompt tokens cached)", prefill_id,
                 reply.num_cached_tokens, reply.num_prompt_tokens)
    return reply


async def _move(attempt: Attempt, move: MoveOffer) -> Prefilled | None:
    """The planned move's Prefill on the draining worker: its reply, or None when the
    worker refused it having sent nothing (see the module docstring). However it ends but
    moved, an Abort of the parked request frees its KV at once (a refusal may leave it
    parked, and a drain waits for every parked request until its offer ends)."""
    moved = False
    try:
        reply = await _move_call(attempt, move)
        moved = reply is not None
        return reply
    finally:
        if not moved:
            _abort_parked(attempt.ctx, move)


async def _move_call(attempt: Attempt, move: MoveOffer) -> Prefilled | None:
    ctx = attempt.ctx
    assert attempt.target is not None
    try:
        call = ctx.calls.start_prefill(move.worker_id, attempt.id, attempt.lease, attempt.target,
                                       ctx.timeout(), moved_from=move.attempt_id)
    except KeyError:
        _replayed(attempt, move, "it left the registry")
        return None
    ctx.trace.mark("prefill_started")
    attempt.prefill_started(move.worker_id)
    attempt.track(call)
    try:
        with ctx.pool.watched(move.worker_id, call):
            reply = WorkerCalls.prefilled(await call)
    except asyncio.CancelledError:
        reraise_if_we_are_cancelled()
        ctx.metrics.kv_moves.labels("replayed").inc()
        raise Retry(f"the move from {move.worker_id} stopped answering health checks",
                    "health") from None
    except grpc.aio.AioRpcError as exc:
        failure = ctx.failure(exc)
        ctx.check_deadline(failure)
        if exc.code() in MOVE_REFUSALS:
            attempt.prefill_released()  # it holds nothing of this attempt
            _replayed(attempt, move, str(failure))
            return None
        ctx.metrics.kv_moves.labels("replayed").inc()
        raise Retry(f"the move from {move.worker_id} failed: {failure}", "prefill") from None
    attempt.prefill_released()
    ctx.trace.mark("prefill_returned")
    ctx.trace.prefill = reply.times
    ctx.metrics.kv_moves.labels("moved").inc()
    ctx.log.info("moved from %s with its KV (%d tokens)", move.worker_id,
                 len(ctx.request.prompt_token_ids) + ctx.calls.num_resumed)
    return reply


def release_move(ctx: RequestContext) -> None:
    """A move offered and never asked for (the request ended first: cancelled, past its
    deadline): an Abort of the parked attempt frees its KV now, not at the offer's end."""
    move, ctx.pending_move = ctx.pending_move, None
    if move is not None:
        _abort_parked(ctx, move)


def _abort_parked(ctx: RequestContext, move: MoveOffer) -> None:
    """An Abort of the request ``move`` parked on the draining worker, in the background
    (a no-op there once it moved or its offer ended)."""
    call = ctx.calls.start_abort(move.worker_id, "decode", move.attempt_id)
    if call is not None:
        ctx.background(asyncio.ensure_future(_quietly(call)))


async def _quietly(call: grpc.aio.UnaryUnaryCall) -> None:
    try:
        await call
    except grpc.aio.AioRpcError:
        pass  # the worker frees it at the offer's end anyway


def _replayed(attempt: Attempt, move: MoveOffer, why: str) -> None:
    attempt.ctx.metrics.kv_moves.labels("replayed").inc()
    attempt.ctx.log.warning("the move from %s was refused (%s): replaying", move.worker_id, why)


async def prefill_verdict(task: asyncio.Future[Prefilled]) -> Retry | RouteError | None:
    """How the Prefill ended, waited for up to ``PREFILL_VERDICT_S`` after the Generate
    stream failed before its first chunk: its failure (which names the prefill worker, as
    when the Prefill fails first), or None (it returned, or has not answered)."""
    if not task.done():
        await asyncio.wait((task,), timeout=PREFILL_VERDICT_S)
    if not task.done() or task.cancelled():
        return None
    failure = task.exception()
    return failure if isinstance(failure, Retry | RouteError) else None
