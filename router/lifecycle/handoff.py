"""``Handoff``: the retry loop of one request's lifecycle (the rooms: ``router.lifecycle``).

``stream()`` places an attempt (``Placement.place``; the request's first placement waits
its turn in the router's FIFO queue, ``Ticket.turn``, while no decode worker can take
it; later ones go ahead of the queue), runs it (``relay.prefill_and_relay``, or
``relay.relay`` of a local attempt) and yields its chunks. Before the first token
reaches the client:

- a worker failure (unreachable, KV transfer failed or corrupt, worker draining) —
  ``Retry`` — aborts the attempt on its decode worker (awaited, bounded, so a retry finds
  the blocks free) and starts a new attempt excluding the failed worker, up to
  ``max_attempts`` failed attempts; then UNAVAILABLE naming every failure;
- a worker at a limit — ``Busy`` — aborts the attempt, waits for capacity and tries again
  without spending an attempt.

After the first token nothing is retried: UNAVAILABLE naming how many tokens were
streamed. The client's deadline is handed to every worker call; a passed deadline is
DEADLINE_EXCEEDED. A failure the loop does not expect (a bug, a value no code path
checked) ends the request with INTERNAL — never a hang — and, like every other end, the
attempt's ``end()`` releases everything it held. Every attempt is ended exactly once,
however the request ends (finish, failure, retry, client cancel).

Test-only pause points (``cluster.pause_points``): ``router.queued`` before a request
waits its turn, ``router.before_prefill`` once its reservation is held,
``router.before_generate`` once its Prefill is under way (the Generate stream not opened).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc

from cluster import pause_points
from router.errors import RouteError
from router.lifecycle.attempt import Attempt
from router.lifecycle.context import RequestContext
from router.lifecycle.outcomes import Busy, Retry
from router.lifecycle.placement import Placement
from router.lifecycle.relay import prefill_and_relay, relay, start_generate
from router.outputs import OutputChunk


class Handoff:
    """Drives one validated, admitted request to completion; iterate ``stream()`` once."""

    def __init__(self, ctx: RequestContext, placement: Placement) -> None:
        self.ctx = ctx
        self.placement = placement

    async def stream(self) -> AsyncGenerator[OutputChunk, None]:
        """The request's output chunks; raises ``RouteError`` on failure."""
        try:
            async for chunk in self._attempts():
                yield chunk
        except RouteError as exc:
            if exc.code == grpc.StatusCode.UNAVAILABLE and self.ctx.clock() >= self.ctx.deadline:
                # the workers gave up because the caller's time ran out: say so
                raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "the request's deadline passed while the workers were serving "
                                 "it", detail=f"{exc.message} ({exc.detail})") from None
            raise
        except GeneratorExit:
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure: INTERNAL, never a hang
            self.ctx.log.exception("the request failed unexpectedly")
            raise RouteError(grpc.StatusCode.INTERNAL,
                             f"the router failed to serve the request: {type(exc).__name__}"
                             ) from exc

    async def _attempts(self) -> AsyncGenerator[OutputChunk, None]:
        ctx, failures = self.ctx, list[str]()
        while len(failures) < ctx.config.max_attempts:
            attempt = await self._place()
            try:
                async with aclosing(self._run(attempt)) as relayed:
                    async for chunk in relayed:
                        yield chunk
                return
            except Busy as busy:  # not the worker's fault: wait, then place again
                ctx.metrics.retries.labels("busy").inc()
                ctx.log.info("attempt %s: %s; waiting for capacity", attempt.id, busy)
                await attempt.abort_decode_now()
                await ctx.ticket.admission.capacity_changed(ctx.deadline)
            except Retry as retry:
                ctx.metrics.retries.labels(retry.cause).inc()
                failures.append(str(retry))
                last = len(failures) >= ctx.config.max_attempts
                ctx.log.warning("attempt %s failed, %s: %s", attempt.id,
                                "giving up" if last else "retrying", retry)
                if attempt.decode_id not in ctx.excluded:  # the next Reserve may go there
                    await attempt.abort_decode_now()
            finally:
                attempt.end()
        raise RouteError(grpc.StatusCode.UNAVAILABLE,
                         f"the workers failed {len(failures)} times before the first token",
                         detail="; ".join(failures))

    async def _place(self) -> Attempt:
        """The next attempt; the request's first placement waits its turn in the queue."""
        ctx = self.ctx
        if ctx.ticket.placed_at is not None:
            return await self.placement.place()
        if pause_points.enabled():
            await pause_points.apause("router.queued", request_id=ctx.client_request_id)
        async with ctx.ticket.turn(ctx.deadline):
            ctx.trace.mark("turn")
            attempt = await self.placement.place()
        ctx.ticket.placed()
        return attempt

    async def _run(self, attempt: Attempt) -> AsyncGenerator[OutputChunk, None]:
        ctx = self.ctx
        if not attempt.local and pause_points.enabled():
            await pause_points.apause("router.before_prefill",
                                      request_id=ctx.client_request_id, attempt_id=attempt.id)
        with ctx.pool.busy(attempt.decode_id):
            chunks_of = (relay(attempt, start_generate(attempt)) if attempt.local
                         else prefill_and_relay(attempt, self.placement))
            async with aclosing(chunks_of) as relayed:
                async for chunk in relayed:
                    yield chunk
