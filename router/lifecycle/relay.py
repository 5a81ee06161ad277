"""The decode worker's stream of an attempt, relayed to the client.

``relay`` reads a Generate (or GenerateLocal) stream: a failure before the first token is
``Retry`` (or ``Busy``), after it ``Migrate`` naming how many tokens were streamed (the
handoff continues the stream elsewhere, or ends it with UNAVAILABLE); a refusal of what
the router sent (a router bug) is INTERNAL, never migrated.
``prefill_and_relay`` opens the Generate stream together with the Prefill (or after
it, when the Prefill went out with the Reserve: ``Attempt.ahead``): the first
chunk leaves as soon as the KV has arrived on the decode worker, not after the Prefill
reply's trip back and a Generate call behind it; until that chunk a failed Prefill fails
the attempt (the stream is cancelled with it); once the stream is done, the Prefill's
reply is awaited briefly for its timings, then the call is let go. A request that asks
for logprobs waits for that reply before its first chunk: the first token's logprobs
come with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import replace

import grpc

from cluster import pause_points
from cluster.moves import is_move_offer
from router.errors import RouteError
from router.lifecycle.attempt import Attempt
from router.lifecycle.outcomes import Busy, Migrate, MoveOffer, Retry, reraise_if_we_are_cancelled
from router.lifecycle.placement import Placement
from router.lifecycle.prefill import prefill, prefill_verdict
from router.outputs import OutputChunk
from router.worker_calls import Failure, Prefilled, chunks

# how long a finished stream waits for its Prefill's reply (normally back already: the
# prefill worker answers once the decode side acknowledged the KV) before letting it go
PREFILL_SETTLE_S = 1.0


def start_generate(attempt: Attempt) -> grpc.aio.UnaryStreamCall:
    """The reservation's Generate stream (``local``: GenerateLocal, which prefills there)."""
    ctx = attempt.ctx
    try:
        if attempt.local:
            ctx.trace.worker_call()
        ctx.trace.mark("generate_started")
        start = ctx.calls.start_generate_local if attempt.local else ctx.calls.start_generate
        call = start(attempt.decode_id, attempt.id, attempt.lease, ctx.timeout())
    except KeyError:  # left the registry meanwhile (its channel is closed)
        ctx.excluded.add(attempt.decode_id)
        attempt.decode_holds_nothing()
        raise Retry(f"decode worker {attempt.decode_id} left the registry",
                    "worker_left") from None
    attempt.track(call)
    return call


async def relay(attempt: Attempt, call: grpc.aio.UnaryStreamCall
                ) -> AsyncGenerator[OutputChunk, None]:
    """The decode worker's stream (see the module docstring)."""
    ctx, decode_id = attempt.ctx, attempt.decode_id
    num_streamed = 0
    try:
        with ctx.pool.watched(decode_id, call):
            async for chunk in chunks(call):
                ctx.pool.heard_from(decode_id)
                if chunk.worker_s is not None:  # the first chunk
                    ctx.trace.mark("first_chunk")
                    ctx.trace.decode_first_chunk_s = chunk.worker_s
                    attempt.streaming()
                num_streamed += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    attempt.finished()
                yield chunk
    except asyncio.CancelledError:
        reraise_if_we_are_cancelled()
        if attempt.is_finished:  # its last chunk is relayed: nothing is lost
            return
        ctx.excluded.add(decode_id)
        why = "stopped answering health checks"
        if num_streamed == 0:
            raise Retry(f"decode worker {decode_id} {why}", "health") from None
        raise Migrate(f"the decode worker {why}", "health", num_streamed, decode_id) from None
    except grpc.aio.AioRpcError as exc:
        if attempt.is_finished:  # the worker died after its last chunk: nothing is lost
            ctx.log.info("the decode worker's stream failed after its last chunk: %s",
                         exc.code().name)
            return
        failure = ctx.failure(exc)
        ctx.check_deadline(failure)
        if num_streamed == 0 and failure.kind is Failure.BUSY:
            raise Busy(f"{decode_id} is busy: {failure}") from None
        if num_streamed == 0 and failure.kind is Failure.RETRY:
            ctx.excluded.add(decode_id)
            raise Retry(f"generate on {decode_id}: {failure}", "generate") from None
        if failure.kind in (Failure.REFUSED, Failure.ALREADY_EXISTS):
            raise RouteError(grpc.StatusCode.INTERNAL,
                             f"the decode worker refused the stream after {num_streamed} "
                             "streamed tokens", detail=f"{decode_id}: {failure}") from None
        ctx.worker_failed(decode_id, failure)
        move = MoveOffer(decode_id, attempt.id) if is_move_offer(failure.details) else None
        cause = "draining" if "shutting down" in failure.details or move else "died"
        raise Migrate("the decode worker failed", cause, num_streamed,
                      f"{decode_id}: {failure}", move) from None
    if not attempt.is_finished:
        ctx.excluded.add(decode_id)
        if num_streamed == 0:
            raise Retry(f"decode worker {decode_id} ended the stream without a token",
                        "generate")
        raise Migrate("the decode worker ended the stream without a finish reason", "ended",
                      num_streamed, decode_id)


async def prefill_and_relay(attempt: Attempt, placement: Placement
                            ) -> AsyncGenerator[OutputChunk, None]:
    """The Prefill and the Generate stream of a reserved attempt (see the module
    docstring)."""
    ctx = attempt.ctx
    prefill_task = attempt.ahead if attempt.ahead is not None \
        else asyncio.ensure_future(prefill(attempt, placement))
    relayed: AsyncGenerator[OutputChunk, None] | None = None
    first: asyncio.Future[OutputChunk | None] | None = None
    try:
        # the Prefill goes out first: the prompt's compute waits for it, while the stream
        # has until the KV arrives to be open
        await asyncio.sleep(0)
        if pause_points.enabled():
            await pause_points.apause("router.before_generate",
                                      request_id=ctx.client_request_id, attempt_id=attempt.id)
        relayed = relay(attempt, start_generate(attempt))
        first = asyncio.ensure_future(_next(relayed))
        try:
            await asyncio.wait((first, prefill_task), return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                prefill_task.result()  # raises the Prefill's failure; a reply: the KV is there
                await asyncio.wait((first,))
        finally:
            if not first.done():
                first.cancel()
                await asyncio.wait((first,))
        try:
            chunk = first.result()
        except Retry:  # e.g. the KV failed its checksum: whose fault the Prefill says
            blame = await prefill_verdict(prefill_task)
            if blame is None:
                raise
            ctx.excluded.discard(attempt.decode_id)  # the decode worker only reported it
            raise blame from None
        sampling = ctx.request.sampling
        prompt_logprobs = sampling.prompt_logprobs is not None and not ctx.calls.num_resumed
        if chunk is not None and (sampling.logprobs is not None or prompt_logprobs):
            chunk = await _with_prefill_logprobs(chunk, prefill_task,
                                                 sampling.logprobs is not None, prompt_logprobs,
                                                 len(ctx.request.prompt_token_ids))
        if chunk is not None:
            yield chunk
            async for chunk in relayed:
                yield chunk
    finally:
        if first is not None and first.done() and not first.cancelled():
            first.exception()  # retrieved: raised above, or superseded by a cancel
        try:
            if relayed is not None:
                await relayed.aclose()
        finally:
            await _settle(attempt, prefill_task,
                          PREFILL_SETTLE_S if attempt.is_finished else 0.0)


async def _with_prefill_logprobs(chunk: OutputChunk, task: asyncio.Future[Prefilled],
                                 first_logprobs: bool, prompt_logprobs: bool,
                                 num_prompt_tokens: int) -> OutputChunk:
    """The stream's first chunk with what the Prefill's reply has of the logprobs asked
    for: with ``first_logprobs`` its first token's (the decode worker has those of the
    tokens it sampled only), with ``prompt_logprobs`` the prompt's. The reply is on its way: the prefill
    worker answers once the KV was acknowledged. A failed Prefill fails the attempt here,
    before anything was streamed."""
    prefilled = await asyncio.shield(task)
    if first_logprobs:
        if prefilled.first_token_logprobs is None:
            raise RouteError(grpc.StatusCode.INTERNAL, "the prefill worker sent no logprobs "
                             "for the first token")
        chunk = replace(chunk, logprobs=(prefilled.first_token_logprobs, *chunk.logprobs))
    if prompt_logprobs:
        if len(prefilled.prompt_logprobs) != max(0, num_prompt_tokens - 1):
            raise RouteError(grpc.StatusCode.INTERNAL, "the prefill worker sent the logprobs "
                             f"of {len(prefilled.prompt_logprobs)} prompt tokens for a prompt "
                             f"of {num_prompt_tokens}")
        chunk = replace(chunk, prompt_logprobs=prefilled.prompt_logprobs)
    return chunk


async def _settle(attempt: Attempt, task: asyncio.Future[Prefilled], wait_s: float) -> None:
    """Let the Prefill task end: waited for up to ``wait_s``, then cancelled — cancelled
    also when this task is cancelled meanwhile, however often (``Attempt.end`` then aborts
    the attempt on the prefill worker if its call had not returned)."""
    try:
        if not task.done() and wait_s > 0:
            await asyncio.wait((task,), timeout=wait_s)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.shield(asyncio.wait((task,)))
    if not task.cancelled() and task.exception() is not None and wait_s > 0:
        attempt.ctx.log.warning("the Prefill call failed after the stream ended: %r",
                                task.exception())


async def _next(chunks_of: AsyncGenerator[OutputChunk, None]) -> OutputChunk | None:
    """The next chunk, or None when the stream is over."""
    try:
        return await anext(chunks_of)
    except StopAsyncIteration:
        return None
