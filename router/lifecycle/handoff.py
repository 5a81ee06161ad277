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
  without spending an attempt;
- a prefill worker whose queue, with what it lacks of the prompt, is longer than the
  decode worker's own prefill would take (``conditional.queue_limit``) —
  ``QueueRefused`` — aborts the attempt and places one that prefills on a decode worker,
  without spending an attempt.

After the first token, a decode worker that fails the stream (the call fails, it stops
answering health checks, it ends the stream without a finish reason) — ``Migrate`` — is
excluded and the stream continues on another one, up to ``migration_limit`` times: the
new attempt's "prompt" is the prompt and every token sent so far, marked as resumed
output (``num_resumed_tokens`` in the internal API), so the workers prefill it (the
prefill worker's cache holds the prompt) and count it as output — ``max_tokens``, the
usage, the text stream (text withheld for a possible stop string is rebuilt, neither
lost nor sent twice) — and sampling continues at the next position, which for seeded
sampling is the token the failed worker would have drawn. The client sees one stream;
past the limit, UNAVAILABLE naming how many tokens were streamed. A draining decode
worker may offer to move the stream with its KV (``Migrate.move``, ``cluster.moves``):
the next attempt's Prefill then goes to that worker, which sends the KV it holds, and to
the prefill workers (replay) only when the move fails. The client's deadline is handed to every worker call; a passed deadline is
DEADLINE_EXCEEDED. A failure the loop does not expect (a bug, a value no code path
checked) ends the request with INTERNAL — never a hang — and, like every other end, the
attempt's ``end()`` releases everything it held. Every attempt is ended exactly once,
however the request ends (finish, failure, retry, client cancel).

Test-only pause points (``cluster.pause_points``): ``router.queued`` before a request
waits its turn, ``router.before_prefill`` once its reservation is held (a Prefill that
went out with the Reserve is under way by then),
``router.before_generate`` once its Prefill is under way (the Generate stream not opened).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import ExitStack, aclosing

import grpc

from cluster import pause_points
from router.errors import RouteError
from router.lifecycle import coalesce
from router.lifecycle.attempt import Attempt
from router.lifecycle.conditional import local_tokens
from router.lifecycle.context import RequestContext
from router.lifecycle.outcomes import Busy, Migrate, QueueRefused, Retry
from router.lifecycle.placement import Placement
from router.lifecycle.prefill import prefill, release_move
from router.lifecycle.relay import prefill_and_relay, relay, start_generate
from router.outputs import OutputChunk
from router.worker_calls import Prefilled

# planned moves of one stream at most (each off a draining worker): a bound, never a policy
MAX_PLANNED_MOVES = 16


class Handoff:
    """Drives one validated, admitted request to completion; iterate ``stream()`` once."""

    def __init__(self, ctx: RequestContext, placement: Placement,
                 resumed: tuple[int, ...] = ()) -> None:
        """``resumed``: the tokens a resumed stream's client has (``router.resume``): the
        stream goes on after them, as after a migration."""
        self.ctx = ctx
        self.placement = placement
        self.sent: list[int] = list(resumed)  # the tokens the client has, in order
        if resumed:
            ctx.calls.resume(resumed)
        self.migrations = 0  # after a failure (counted against the migration limit)
        self.planned_moves = 0  # offered by a draining worker (not counted against it)
        self._last_chunk_at: float | None = None
        self._migrated_at: float | None = None  # the last token before the last migration
        self._migrating: str | None = None  # why the last migration left its worker

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
        finally:
            release_move(self.ctx)  # a move offered and never asked for (cancel, deadline)
            coalesce.ended(self.placement)  # the requests waiting for its KV go on

    async def _attempts(self) -> AsyncGenerator[OutputChunk, None]:
        ctx, failures = self.ctx, list[str]()
        while len(failures) < ctx.config.max_attempts:
            attempt = await self._place_after(failures)
            try:
                async with aclosing(self._run(attempt)) as relayed:
                    async for chunk in relayed:
                        self._relayed(chunk)
                        if chunk.worker_s is not None or chunk.finish_reason is not None:
                            self.placement.kv_landed(attempt)
                            coalesce.ended(self.placement)
                        yield chunk
                return
            except Migrate as migrate:
                failures.clear()  # the next attempt starts afresh, after the tokens sent
                self._migrate(attempt.id, migrate)  # past the limit, the Abort frees a move
                if migrate.move is not None:  # parked for the move: no Abort goes there
                    attempt.decode_holds_nothing()
                self._migrating = str(migrate)
                ctx.pending_move = migrate.move
            except QueueRefused as refused:  # the next attempt prefills on a decode worker
                ctx.log.info("attempt %s: %s; prefilling on the decode worker", attempt.id,
                             refused)
                await attempt.abort_decode_now()
                ctx.local_reason = "local_queue_wait" if refused.by_router \
                    else "local_queue_refused"
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
                         f"the workers failed {len(failures)} times before the first token"
                         if not self.sent else
                         f"{self._migrating} after {len(self.sent)} streamed tokens, and the "
                         f"workers failed {len(failures)} times to continue it",
                         detail="; ".join(failures))

    def _relayed(self, chunk: OutputChunk) -> None:
        now = self.ctx.clock()
        if self._migrated_at is not None and chunk.token_ids:
            self.ctx.metrics.migration_stall.observe(now - self._migrated_at)
            self._migrated_at = None
        self.sent.extend(chunk.token_ids)
        self._last_chunk_at = now

    def _migrate(self, attempt_id: str, migrate: Migrate) -> None:
        """Continue after ``migrate`` on another decode worker (the next attempt resumes
        after ``sent``), or UNAVAILABLE past the migration limit. A move a draining worker
        offered is planned, not a failure: it does not count against the limit (with the
        limit 0 a drain would fail every stream it moves), only against
        ``MAX_PLANNED_MOVES``."""
        ctx, limit = self.ctx, self.ctx.config.migration_limit
        planned = migrate.move is not None and self.planned_moves < MAX_PLANNED_MOVES
        if not planned and self.migrations >= limit:
            ctx.log.warning("attempt %s: %s (%s); migration limit %d reached", attempt_id,
                            migrate, migrate.detail, limit)
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"{migrate} after {len(self.sent)} streamed tokens"
                             + (f" ({self.migrations} migrations, the limit)" if limit else ""),
                             detail=migrate.detail)
        ctx.metrics.migrations.labels(migrate.cause).inc()
        if planned:
            self.planned_moves += 1
            ctx.log.info("attempt %s: %s after %d streamed tokens (%s); moving (planned move "
                         "%d)", attempt_id, migrate, len(self.sent), migrate.detail,
                         self.planned_moves)
        else:
            self.migrations += 1
            ctx.log.warning("attempt %s: %s after %d streamed tokens (%s); migrating (%d of "
                            "%d)", attempt_id, migrate, len(self.sent), migrate.detail,
                            self.migrations, limit)
        self._migrated_at = self._last_chunk_at
        ctx.calls.resume(tuple(self.sent))

    async def _place_after(self, failures: list[str]) -> Attempt:
        """The next attempt; after a migration, a placement that fails says what the
        stream had streamed and why it left its worker."""
        try:
            return await self._place()
        except RouteError as exc:
            if self._migrating is None or exc.code != grpc.StatusCode.UNAVAILABLE:
                raise
            raise RouteError(exc.code, f"{self._migrating} after {len(self.sent)} streamed "
                             f"tokens, and no other worker could continue it: {exc.message}",
                             detail="; ".join([*failures, exc.detail or ""])) from None

    async def _place(self) -> Attempt:
        """The next attempt; the request's first placement waits its turn in the queue."""
        ctx = self.ctx
        if ctx.ticket.placed_at is not None:
            return await self.placement.place(self._prefill)
        if pause_points.enabled():
            await pause_points.apause("router.queued", request_id=ctx.client_request_id)
        await coalesce.wait_for_prefix(self.placement)  # before its turn: never holding it
        async with ctx.ticket.turn(ctx.deadline):
            ctx.trace.mark("turn")
            attempt = await self.placement.place(self._prefill)
        ctx.ticket.placed()
        return attempt

    async def _prefill(self, attempt: Attempt) -> Prefilled:
        """The attempt's Prefill, when it goes out ahead of its Reserve's reply."""
        return await prefill(attempt, self.placement)

    async def _run(self, attempt: Attempt) -> AsyncGenerator[OutputChunk, None]:
        ctx = self.ctx
        if not attempt.local and pause_points.enabled():
            await pause_points.apause("router.before_prefill",
                                      request_id=ctx.client_request_id, attempt_id=attempt.id)
        with ctx.pool.busy(attempt.decode_id), ExitStack() as prefilling:
            if attempt.local:  # its prompt counts on the decode worker until its first token
                prefilling.enter_context(ctx.pool.prefilling(
                    attempt.decode_id, local_tokens(self.placement, attempt.decode_id)))
            chunks_of = (relay(attempt, start_generate(attempt)) if attempt.local
                         else prefill_and_relay(attempt, self.placement))
            async with aclosing(chunks_of) as relayed:
                async for chunk in relayed:
                    prefilling.close()
                    yield chunk
