"""Where an attempt runs: the decode worker that reserves its KV (or prefills it locally),
and the order in which prefill workers are asked.

- Decode: within the load bound, the longest cached prefix of the prompt (kv-aware, with a
  trusted KV index; a worker this router saw the prompt's first block land on in the last
  seconds counts as holding one, ``router.recent_kv``), then least in flight, then most
  free blocks
  (``router.routing.rank_decode``), among the routable decode workers that did not fail
  this request; the later choices of one
  request (n > 1) ask the first choice's decode worker first (``SharedDecode``: its prefix
  cache holds their prompt). ``reserve`` asks them in
  turn, a new attempt per Reserve; while every reachable one refuses (no room now, or at
  its stream limit) it waits for capacity until the deadline; when none answers at all,
  UNAVAILABLE. A pass's first Reserve sends the attempt's Prefill with it, not after its
  reply, when the router can name the target (``router.lifecycle.ahead``).
- Local: colocated mode (``local_prefill`` "always"), or "fallback" once no prefill
  worker is left for the request, or a later choice of n > 1 whose first choice's
  decode worker can take it, or conditional disaggregation (kv-aware, every mode): the
  decode worker holds all of the prompt but a short tail, or every prefill worker's queue
  and what it lacks of the prompt come to more than its own side (as the router sees the
  queues, or as the prefill workers count their own, refusing the attempt's Prefill:
  ``QueueRefused``; ``router.lifecycle.conditional``): the attempt prefills on the
  decode worker.
- Prefill: kv-aware, the least predicted work (tokens queued there plus this prompt's
  tokens it does not hold, over its measured speed: ``router.policy.choose_prefill``);
  affinity, and kv-aware while the KV index cannot be trusted, rendezvous order of the
  prompt's affinity key with bounded load (``router.routing.pick_prefill``); or in turn (``prefill_routing``
  "round-robin"). The decision itself is ``router.policy`` (I/O-free: the simulator runs
  it too); this class feeds it and makes the calls. Each decision is counted by why its
  first choice won (``pdserve:router_decisions_total``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import grpc

from cluster.kv_target import KVTarget
from router.errors import RouteError
from router.lifecycle.ahead import AheadGate, ahead_target
from router.lifecycle.attempt import Attempt, AttemptIds
from router.lifecycle.conditional import conditional_reason, prefill_len, why_local
from router.lifecycle.context import RequestContext
from router.lifecycle.outcomes import reraise_if_we_are_cancelled
from router.lifecycle.prompt_kv import PromptKV
from router.policy import PrefillChoice, choose_prefill
from router.recent_kv import RecentKV
from router.routing import DecodeCandidate, rank_decode, uncached_tokens
from router.worker_calls import Failure, Prefilled, WorkerCalls

# starts an attempt's Prefill (``router.lifecycle.prefill.prefill``): what goes ahead
PrefillStarter = Callable[[Attempt], Coroutine[Any, Any, Prefilled]]


class Placement:
    """The placement decisions of one request (``ctx``); ``ids`` mints its attempts' ids,
    ``transfer_ids`` its transfers', ``turns`` is the router's round-robin counter."""

    def __init__(self, ctx: RequestContext, ids: AttemptIds, transfer_ids: Iterator[int],
                 turns: Iterator[int] | None = None, gate: AheadGate | None = None) -> None:
        self.ctx = ctx
        self.gate = gate if gate is not None else AheadGate()
        self._ids = ids
        self._transfer_ids = transfer_ids
        self._turns = turns
        self._turn: int | None = None  # this request's round-robin turn, once drawn
        self.prompt_kv = PromptKV(ctx)
        self.prefill_choice = PrefillChoice([], "")  # the last ``prefill_order``'s
        self._decode_held: dict[str, int] = {}  # blocks each decode worker holds (index)
        self._no_ahead = False  # a Reserve with its Prefill sent ahead failed: no more

    # ----------------------------------------------------------------- decode

    def decode_order(self, received: bool = True) -> list[str]:
        """The decode workers to ask, best first; ``received``: the attempt's KV arrives
        from a prefill worker (else it is computed there: a lossy wire's blocks, keyed
        apart on the worker, are no use to it)."""
        ctx = self.ctx
        order, cached = self._decode_ranking(ctx.received_kv_salt if received else "")
        self._decode_held = cached
        if not order:
            need = ctx.request.num_blocks(ctx.block_size)
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"no healthy decode worker can hold {need} KV blocks")
        shared = ctx.shared_decode
        if shared is not None and shared.worker_id in order:
            order.remove(shared.worker_id)
            order.insert(0, shared.worker_id)
            reason = "sibling"
        else:
            reason = "kv_hit" if cached.get(order[0]) else "load"
        ctx.metrics.decisions.labels("decode", reason).inc()
        return order

    def _decode_ranking(self, salt: str = "") -> tuple[list[str], dict[str, int]]:
        """(``rank_decode``'s order of the decode workers that may take this attempt, the
        leading prompt blocks each holds under ``salt``'s keys)."""
        ctx = self.ctx
        records = [r for r in ctx.pool.routable("decode") if r.worker_id not in ctx.excluded]
        hashes = self.prompt_kv.block_hashes(salt) if self.prompt_kv.trusted() else []
        cached = self.prompt_kv.cached_blocks([r.worker_id for r in records], salt,
                                              self.gate.recent)
        candidates = _decode_candidates(ctx, records, cached, self.gate.recent, hashes)
        return rank_decode(candidates, ctx.request.num_blocks(ctx.block_size),
                           ctx.config.load_epsilon), cached

    def prefills_locally(self) -> bool:
        """Colocated this attempt (never while a planned move is pending: its KV goes to a
        reservation): always, (fallback) when no prefill worker is left, a
        later choice that its first choice's decode worker can take, or conditional
        disaggregation's choice (``_conditional``)."""
        mode = self.ctx.config.local_prefill
        if self.ctx.pending_move is not None:
            return False  # the KV moves to a reservation (router.lifecycle.prefill)
        return mode == "always" or self._sibling_worker() is not None or (
            mode == "fallback" and not any(r.worker_id not in self.ctx.excluded
                                           for r in self.ctx.pool.routable("prefill"))
        ) or self.ctx.local_reason is not None or self._conditional() is not None

    def _conditional(self) -> str | None:
        """Conditional disaggregation's reason to prefill on the decode worker a local
        attempt would take (``conditional.conditional_reason``), or None (also when off: not
        kv-aware, ``local_prefill_max_tokens`` 0, or a resumed stream)."""
        ctx = self.ctx
        if not ctx.config.local_prefill_max_tokens or ctx.calls.num_resumed \
                or ctx.config.prefill_routing != "kv-aware":
            return None
        order, held = self._decode_ranking()
        return conditional_reason(self, order[0], held.get(order[0], 0)) if order else None

    def _sibling_worker(self) -> str | None:
        """The decode worker holding a later choice's prompt (``SharedDecode``), if it is
        routable and did not fail this choice."""
        ctx, shared = self.ctx, self.ctx.shared_decode
        if not ctx.choice or shared is None or shared.worker_id is None \
                or shared.worker_id in ctx.excluded:
            return None
        routable = {r.worker_id for r in ctx.pool.routable("decode")}
        return shared.worker_id if shared.worker_id in routable else None

    async def place(self, ahead: PrefillStarter | None = None) -> Attempt:
        """The next attempt: local, or a reservation (waiting for capacity meanwhile). With
        ``ahead``, a pass's first Reserve sends the attempt's Prefill (``ahead(attempt)``)
        together with it, when the router can name the target (``router.lifecycle.ahead``)."""
        self.ctx.metrics.attempts.inc()
        self.ctx.trace.attempts += 1
        return self._local_attempt() if self.prefills_locally() else await self._reserve(ahead)

    def _local_attempt(self) -> Attempt:
        ctx = self.ctx
        decode_id = self.decode_order(received=False)[0]
        ctx.metrics.routed.labels("decode", decode_id).inc()
        attempt = Attempt(ctx, self._ids.new(), decode_id, local=True)
        self._share(decode_id)
        colocated, sibling = ctx.config.local_prefill == "always", self._sibling_worker()
        refused, ctx.local_reason = ctx.local_reason, None  # for this attempt only
        conditional = None if colocated or sibling == decode_id else refused or self._conditional()
        if conditional is not None:
            ctx.metrics.decisions.labels("prefill", conditional).inc()
        ctx.log.info("attempt %s: prefilling locally on %s (%s)", attempt.id, decode_id,
                     why_local(colocated, sibling == decode_id, conditional))
        return attempt

    def kv_landed(self, attempt: Attempt) -> None:
        """``attempt``'s decode worker streamed its first token or finished: it holds the
        prompt's blocks, which the KV index may not list yet (``router.recent_kv``)."""
        if self.ctx.config.prefill_routing == "kv-aware":  # else nothing goes ahead
            salt = "" if attempt.local else self.ctx.received_kv_salt
            self.gate.recent.landed(attempt.decode_id, self.prompt_kv.block_hashes(salt))

    def _share(self, decode_id: str, lossy: bool = False) -> None:
        """Choice 0 of n > 1 runs on ``decode_id``: the later choices go there, unless its
        KV arrived over a ``lossy`` wire (keyed apart there: a local prefill finds none)."""
        if self.ctx.shared_decode is not None and not self.ctx.choice:
            self.ctx.shared_decode.worker_id = None if lossy else decode_id

    async def _reserve(self, ahead: PrefillStarter | None) -> Attempt:
        while True:
            attempt, refusals, any_refused = await self._try_reserve(ahead)
            if attempt is not None:
                return attempt
            if not any_refused:
                raise RouteError(grpc.StatusCode.UNAVAILABLE,
                                 f"no decode worker could reserve "
                                 f"{self.ctx.request.num_blocks(self.ctx.block_size)} KV "
                                 "blocks", detail="; ".join(refusals))
            await self.ctx.ticket.admission.capacity_changed(self.ctx.deadline)

    async def _try_reserve(self, ahead: PrefillStarter | None
                           ) -> tuple[Attempt | None, list[str], bool]:
        """One pass over the decode workers: (the attempt, or None with why each refused
        and whether any answered "no room now")."""
        refusals: list[str] = []
        any_refused = False  # a worker answered "no room" (vs. none answering at all)
        for decode_id in self.decode_order():
            attempt = Attempt(self.ctx, self._ids.new(), decode_id,
                              transfer_id=next(self._transfer_ids))
            target = None if ahead is None or self._no_ahead or not self.prompt_kv.trusted() \
                else ahead_target(attempt, self.gate, self._decode_held.get(decode_id, 0),
                                  self.prompt_kv.block_hashes(self.ctx.received_kv_salt))
            starter, ahead = ahead, None  # later choices of the pass wait for their reply
            try:
                refusal = await self._reserve_on(attempt, target, starter)
            except BaseException:
                attempt.end()  # it may hold a reservation there
                raise
            self._no_ahead |= self.gate.answered(attempt, refusal)
            if refusal is None:
                return attempt, refusals, True
            attempt.end()
            refusals.append(f"{decode_id}: {refusal[0]}")
            any_refused = any_refused or refusal[1]
        return None, refusals, any_refused

    async def _reserve_on(self, attempt: Attempt, ahead: KVTarget | None = None,
                          starter: PrefillStarter | None = None) -> tuple[str, bool] | None:
        """The attempt's Reserve (and, ``ahead``, its Prefill to that target: ``starter``):
        None once reserved, else (why not, whether the worker answered "no room now")."""
        ctx, decode_id = self.ctx, attempt.decode_id
        ctx.trace.worker_call()
        try:
            if ahead is not None and starter is not None:
                # the Prefill first: its way to the prefill worker is on the path to the
                # first token; the Reserve only has to arrive before the KV (parked if not)
                attempt.send_ahead(ahead, starter)
                await asyncio.sleep(0)  # its task starts its call before the Reserve's
            call = ctx.calls.start_reserve(decode_id, attempt.id, attempt.lease,
                                           attempt.transfer_id,
                                           ctx.timeout(ctx.config.reserve_timeout_s),
                                           wait_s=ctx.timeout(),
                                           expected_cached_blocks=None if ahead is None
                                           else ahead.num_cached_blocks)
            ctx.trace.mark("reserve_sent")
            # counted by concurrent choices already; cancelled if the worker is hung
            with ctx.pool.busy(decode_id), ctx.pool.watched(decode_id, call):
                reply = WorkerCalls.reserved(await call)
            ctx.pool.heard_from(decode_id)
        except KeyError:  # left the registry meanwhile (its channel is closed)
            attempt.decode_holds_nothing()
            return "left the registry", False
        except asyncio.CancelledError:
            reraise_if_we_are_cancelled()
            ctx.excluded.add(decode_id)  # the pool took the call back: it is hung
            return "stopped answering health checks", False
        except grpc.aio.AioRpcError as exc:
            failure = ctx.failure(exc)
            if failure.kind is Failure.ALREADY_EXISTS:  # not ours to abort
                attempt.decode_holds_nothing()
                raise ctx.id_in_use("") from None
            ctx.check_deadline(failure)
            if failure.kind is Failure.REFUSED:  # the worker refused what the router sent
                raise RouteError(grpc.StatusCode.INTERNAL,
                                 "a decode worker refused the reservation the router sent",
                                 detail=f"reserve on {decode_id}: {failure}") from None
            if failure.kind is not Failure.BUSY:
                ctx.worker_failed(decode_id, failure)
            return str(failure), failure.kind is Failure.BUSY
        if not reply.accepted:
            attempt.decode_holds_nothing()  # refused: nothing is held for it
            return reply.reason, True
        assert reply.target is not None
        if ahead is not None and reply.target != ahead:  # the registry's address is stale
            return f"it reserved {reply.target}, not the target its Prefill named", True
        ctx.trace.mark("reserved")
        attempt.reserved(reply.target)
        self._share(decode_id, lossy=bool(ctx.received_kv_salt))
        ctx.metrics.routed.labels("decode", decode_id).inc()
        ctx.log.info("attempt %s: %d blocks reserved on %s (transfer %d, %d held there)",
                     attempt.id, reply.num_blocks, decode_id, attempt.transfer_id,
                     reply.target.num_cached_blocks)
        return None

    # ----------------------------------------------------------------- prefill

    def prefill_order(self, decode_id: str = "") -> list[str]:
        """The prefill workers to ask, best first (by affinity with bounded load, or in
        turn), among the routable ones that did not fail this request, less ``decode_id``
        (the attempt's decode worker: one that switched to prefill while holding the
        attempt's reservation cannot also prefill it, one engine holding one attempt id)."""
        ctx, mode = self.ctx, self.ctx.config.prefill_routing
        loads = {r.worker_id: ctx.pool.cluster_inflight(r.worker_id)
                 for r in ctx.pool.routable("prefill")
                 if r.worker_id not in ctx.excluded and r.worker_id != decode_id}
        if mode == "round-robin" and self._turn is None:
            self._turn = next(self._turns) if self._turns is not None else 0
        trusted = self.prompt_kv.trusted()
        choice = choose_prefill(
            mode, key=b"" if mode == "round-robin" else self.prompt_kv.affinity_key(), loads=loads,
            queued_tokens={w: ctx.pool.cluster_tokens(w) for w in loads} if trusted else {},
            num_prompt_tokens=prefill_len(ctx), block_size=ctx.block_size,
            cached=self.prompt_kv.cached_blocks(list(loads)) if trusted else None,
            turn=self._turn or 0, epsilon=ctx.config.load_epsilon,
            speeds=ctx.pool.prefill_speeds(loads))
        self.prefill_choice = choice
        if choice.order:
            ctx.metrics.decisions.labels("prefill", choice.reason).inc()
        return choice.order

    def prefill_tokens(self, prefill_id: str) -> int:
        """The prompt tokens ``prefill_id`` computes for this request, as far as the router
        knows (kv-aware: the KV index's word on its prefix cache; else all of them)."""
        return uncached_tokens(prefill_len(self.ctx), self.ctx.block_size,
                               self.prefill_choice.cached.get(prefill_id, 0))


def _decode_candidates(ctx: RequestContext, records: list[Any], cached: dict[str, int],
                       recent: RecentKV, hashes: list[bytes]) -> list[DecodeCandidate]:
    """``rank_decode``'s view of ``records``: a worker this router saw KV of a prompt
    starting as this one (``hashes``) land on lately ranks as holding one block where the
    index shows none yet (``router.recent_kv``): a chat's next turn goes where its last
    one is, and the Reserve's reply says how many it holds."""
    return [DecodeCandidate(r.worker_id, ctx.pool.cluster_inflight(r.worker_id),
                            r.free_kv_blocks, r.total_kv_blocks,
                            cached.get(r.worker_id, 0) or int(recent.may_hold(r.worker_id,
                                                                              hashes)))
            for r in records]
