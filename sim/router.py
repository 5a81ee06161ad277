"""One simulated router: the real admission budgets, routing decisions and KV index,
driven by the simulator's events instead of gRPC calls.

- Admission: ``router.admission.Admission`` on the virtual clock (its budgets refuse
  with RESOURCE_EXHAUSTED as the router's do); admitted requests wait in arrival order
  and only the oldest places itself, retrying when capacity may have changed or every
  ``RETRY_PLACEMENT_S`` (the router's FIFO turn); a deadline that passes while queued
  is DEADLINE_EXCEEDED.
- Decode: ``router.routing.rank_decode`` over the decode workers (the router's in-flight
  counts, their allocatable blocks, the KV index's cached prefix); the first that can
  reserve the prompt's blocks takes it (``SimWorker.reserve``, the engine's own
  reservation). Local prefill (``local_prefill`` always, fallback without prefill
  workers, or conditional disaggregation: ``router.policy.short_tail`` and
  ``prefill_outwaits_local``) puts the whole request on it instead.
- Prefill: ``router.policy.choose_prefill`` — the function ``Placement`` calls.
- Shared by every router (``SharedView``): the attempts on each worker and the prompt
  tokens queued prefills will compute there (less what the KV index says it holds, as
  ``Placement.prefill_tokens``; the routers' shared loads, exchanged at once here), and
  the KV index,
  ``router.kv_index.KVIndex``, fed every ``interval_s`` with each worker's KV events as
  ``cluster.kv_events.EventBatch``es (what the stream carries).

Not modelled: a request waiting for a prompt in flight that covers it but a short tail
(``router.lifecycle.coalesce``), and the prefill workers' queue refusals
(``cluster.prefill_queue``, with the bounds of ``router.policy.queue_bounds``), which
correct a lag of the shared view that the simulator does not have. A burst of prompts
sharing a prefix is prefilled on the prefill workers here where the real router computes
most of their tails on the decode worker.

Costs outside the workers' steps come from the profile: ``router.overhead_s`` per request
before admission, ``handoff.overhead_s`` for the attempt's calls (before the prefill
starts, and with the KV's arrival), and the KV transfer (``Profile.transfer_s`` of the
blocks the decode worker lacks). A busy decode worker answers the Reserve, and streams the
first token that came with the KV, when its step in flight ends (a real worker's loop
runs commands and notices arrived KV between steps).
"""

from __future__ import annotations

import itertools
from collections import deque

import grpc

from engine.core.scheduler import StepUpdate
from engine.kvcache.block_hash import compute_block_hashes
from engine.tp.sharding import num_blocks_for
from router.admission import RETRY_PLACEMENT_S, Admission
from router.config import AdmissionConfig, HandoffConfig
from router.errors import RouteError
from router.lifecycle.ahead import AheadGate
from router.policy import choose_prefill, decode_side, prefill_outwaits_local, short_tail
from router.routing import DecodeCandidate, affinity_key, rank_decode, uncached_tokens
from sim.events import EventQueue
from sim.profile import Profile
from sim.state import SharedView, SimRequest, live
from sim.worker import SimWorker


class SimRouter:
    """See the module doc; ``workers`` by id, prefill ones and decode ones; ``shared``:
    what it knows in common with the other routers."""

    def __init__(self, events: EventQueue, profile: Profile, workers: list[SimWorker],
                 shared: SharedView, *, handoff: HandoffConfig, admission: AdmissionConfig,
                 timeout_s: float) -> None:
        self.events = events
        self.profile = profile
        self.handoff = handoff
        self.timeout_s = timeout_s
        self.block_size = profile.model.block_size
        self._by_id = {w.worker_id: w for w in workers}
        self.admission = Admission(admission.max_inflight, admission.max_queued_tokens,
                                   clock=events.clock, on_capacity=self._capacity_changed)
        self.queue: deque[SimRequest] = deque()
        self.shared = shared
        shared.routers.append(self)
        self.inflight, self.queued_tokens = shared.inflight, shared.queued_tokens
        self.kv_index = shared.kv_index
        # the router's own rule of which decode worker gets a Prefill ahead: not one that
        # refused a Reserve since it last accepted one, nor one this router saw KV of a
        # prompt starting as the request's land on lately (router.recent_kv)
        self.gate = AheadGate(events.clock)
        self.attempts: dict[str, SimRequest] = {}
        self.unfinished = 0
        self._turns = itertools.count()
        self._pump_pending = False
        self._retry_at: float | None = None

    def add_worker(self, worker: SimWorker) -> None:
        """A worker the planner added: routed to from now on, by its role."""
        self._by_id[worker.worker_id] = worker

    @property
    def prefill(self) -> list[SimWorker]:
        """The workers serving prefill now (a role may change while the run goes on)."""
        return [w for w in self._by_id.values() if w.role == "prefill"]

    @property
    def decode(self) -> list[SimWorker]:
        return [w for w in self._by_id.values() if w.role == "decode"]

    # ------------------------------------------------------------------ arrival

    def submit(self, request: SimRequest) -> None:
        """``request`` arrives now."""
        self.unfinished += 1
        self.shared.arrived()
        self.events.after(self.profile.router_overhead_s, self._admit, request)

    def _admit(self, request: SimRequest) -> None:
        try:
            request.ticket = self.admission.enter(request.request_id, request.prompt_len)
        except RouteError as exc:
            self._fail(request, exc.code, exc.message)
            return
        request.block_hashes = compute_block_hashes(request.prompt_token_ids, self.block_size)
        self.queue.append(request)
        self._pump()

    # ------------------------------------------------------------------ the FIFO turn

    def _capacity_changed(self) -> None:
        if not self._pump_pending:
            self._pump_pending = True
            self.events.after(0.0, self._pump)

    def _pump(self) -> None:
        self._pump_pending = False
        while self.queue:
            head = self.queue[0]
            if self.events.now >= head.arrival_s + self.timeout_s:
                self.queue.popleft()
                self._fail(head, grpc.StatusCode.DEADLINE_EXCEEDED,
                           "the request's deadline passed while no worker could take it")
                continue
            try:
                placed = self._place(head)
            except RouteError as exc:
                self.queue.popleft()
                self._fail(head, exc.code, exc.message)
                continue
            if not placed:
                retry = self.events.now + RETRY_PLACEMENT_S
                if self._retry_at is None or self._retry_at <= self.events.now:
                    self._retry_at = retry
                    self.events.at(retry, self._pump)
                return
            self.queue.popleft()

    # ------------------------------------------------------------------ placement

    def _place(self, request: SimRequest) -> bool:
        """Places ``request`` (True), or no decode worker has room now (False)."""
        order, held = self._decode_order(request)
        if not order:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "no decode worker can hold "
                             f"{self._num_blocks(request)} KV blocks")
        h = self.handoff
        lacks = uncached_tokens(len(request.sequence()), self.block_size, held.get(order[0], 0))
        local = h.local_prefill == "always" or (h.local_prefill == "fallback"
                                                and not live(self.prefill)) \
            or self._conditional(request, order[0], held.get(order[0], 0), lacks)
        if local:
            worker = self._worker(order[0])
            self._start(request, worker)
            # its prompt counts on the decode worker until its first token, as the handoff's
            request.local_tokens = lacks
            self.queued_tokens[worker.worker_id] += lacks
            worker.add(request.engine_request(request.attempt))
            return True
        request.remote_attempt = request.num_attempts  # decided: it waits for a Reserve
        attempt = f"{request.request_id}#{request.num_attempts}"
        for decode_id in order:
            worker = self._worker(decode_id)
            # the Prefill goes out with the pass's first Reserve where, by a trusted index,
            # the decode worker holds none of the prompt and its registered free blocks
            # hold the prompt (what a Reserve takes), and no KV of a prompt starting as this one was seen landing
            # there lately, nor did it refuse a Reserve since it last accepted one
            # (router.lifecycle.ahead.ahead_target)
            ahead = decode_id == order[0] and not request.no_ahead and not held.get(
                decode_id, 0) and self.kv_index is not None and self.kv_index.trusted() \
                and worker.reported_free_blocks() >= num_blocks_for(request.prompt_len,
                                                                    self.block_size) \
                and self.gate.allows(decode_id, self._prompt_block(request))
            reserved = worker.reserve(request.engine_request(attempt), 0 if ahead else None)
            # refused here only for want of room
            self.gate.reserve_answered(decode_id, reserved=reserved is not None,
                                       for_want_of_room=True)
            if reserved is None:
                request.no_ahead = request.no_ahead or ahead
                continue
            self._start(request, worker)
            full = num_blocks_for(len(request.sequence()), self.block_size)
            request.kv_bytes = (full - reserved) * self.profile.block_bytes()
            # the Reserve's reply leaves the decode worker's loop after its step in flight;
            # a Prefill sent with the Reserve does not wait for it
            self.events.after((0.0 if ahead else worker.residual_s())
                              + self.profile.handoff_overhead_s / 2,
                              self._prefill, request, request.attempt)
            return True
        return False

    def _conditional(self, request: SimRequest, decode_id: str, held_blocks: int,
                     lacks: int) -> bool:
        """Conditional disaggregation, as ``Placement._conditional`` (kv-aware, not a
        migrated stream): ``short_tail`` or ``prefill_outwaits_local`` (each prefill
        worker's queue plus what it lacks of the prompt, by a trusted index), decided once
        per attempt (an attempt waiting for a Reserve does not turn local)."""
        h, limit = self.handoff, self.handoff.local_prefill_max_tokens
        if h.prefill_routing != "kv-aware" or not limit or request.output_ids \
                or request.remote_attempt == request.num_attempts:
            return False
        trusted = self.kv_index is not None and self.kv_index.trusted()
        if trusted and short_tail(limit, request.prompt_len, self.block_size, held_blocks):
            return True
        workers = [w.worker_id for w in live(self.prefill)]
        cached = self.shared.cached(request, workers) if trusted else {}
        work = {w: self.queued_tokens[w] + uncached_tokens(len(request.sequence()),
                                                           self.block_size, cached.get(w, 0))
                for w in workers}
        return prefill_outwaits_local(limit, work, decode_side(lacks, self.queued_tokens[decode_id]))

    def _start(self, request: SimRequest, decode: SimWorker) -> None:
        assert request.ticket is not None
        request.ticket.placed()
        request.attempt = f"{request.request_id}#{request.num_attempts}"
        request.num_attempts += 1
        request.attempt_from = len(request.output_ids)
        request.decode_worker = decode.worker_id
        self.inflight[decode.worker_id] += 1
        self.attempts[request.attempt] = request
        self.shared.owner[request.attempt] = self

    def _decode_order(self, request: SimRequest) -> tuple[list[str], dict[str, int]]:
        workers = live(self.decode)
        held = self.shared.cached(request, [w.worker_id for w in workers])
        trusted = self.kv_index is not None and self.kv_index.trusted()
        first = self._prompt_block(request) if trusted else []
        # as Placement._decode_ranking: KV seen landing lately counts as one block held
        inflight, held_at, may_hold = self.inflight, held.get, self.gate.recent.may_hold
        candidates = [DecodeCandidate(w.worker_id, inflight[w.worker_id],
                                      w.reported_free_blocks(), w.blocks.num_blocks,
                                      held_at(w.worker_id, 0)
                                      or int(bool(first) and may_hold(w.worker_id, first)))
                      for w in workers]
        return rank_decode(candidates, self._num_blocks(request),
                           self.handoff.load_epsilon), held

    def _prefill(self, request: SimRequest, attempt: str) -> None:
        if request.attempt != attempt:  # the attempt failed meanwhile
            return
        # not the attempt's decode worker, if it switched to prefill since its Reserve (as
        # Placement.prefill_order: one engine cannot hold the attempt twice)
        loads = {w.worker_id: self.inflight[w.worker_id] for w in live(self.prefill)
                 if w.worker_id != request.decode_worker}
        if not loads:  # every prefill worker died (or is that one) after the reservation
            if self.handoff.local_prefill == "never" and not any(
                    w.worker_id == request.decode_worker for w in live(self.prefill)):
                self._abort_attempt(request)  # as prefill.prefill: nothing to retry on
                self._fail(request, grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
            else:  # its decode worker prefills now, or the next attempt prefills locally
                self._retry(request)
            return
        mode = self.handoff.prefill_routing
        if mode == "round-robin" and request.turn is None:
            request.turn = next(self._turns)
        trusted = self.kv_index is not None and self.kv_index.trusted()
        choice = choose_prefill(
            mode, key=affinity_key(request.block_hashes, request.prompt_token_ids,
                                   self.handoff.affinity_blocks),
            loads=loads, queued_tokens=self.queued_tokens if trusted else {},
            num_prompt_tokens=len(request.sequence()), block_size=self.block_size,
            cached=self.shared.cached(request, list(loads)) if trusted else None,
            turn=request.turn or 0,
            epsilon=self.handoff.load_epsilon)
        worker = self._worker(choice.order[0])
        request.prefill_worker = worker.worker_id
        self.inflight[worker.worker_id] += 1
        # the router's count: the tokens the worker computes, as far as the index knows
        request.prefill_tokens = uncached_tokens(len(request.sequence()), self.block_size,
                                                 choice.cached.get(worker.worker_id, 0))
        self.queued_tokens[worker.worker_id] += request.prefill_tokens
        worker.add(request.engine_request(request.attempt, prefill_only=True))

    def _prompt_block(self, request: SimRequest) -> list[bytes]:
        """The hash of the prompt's first full block, if it has one."""
        return request.block_hashes[:1]

    def _num_blocks(self, request: SimRequest) -> int:
        return num_blocks_for(request.prompt_len + request.max_tokens, self.block_size)

    def _worker(self, worker_id: str) -> SimWorker:
        return self._by_id[worker_id]


    # ------------------------------------------------------------------ outputs

    def on_output(self, worker: SimWorker, update: StepUpdate) -> None:
        """A worker's step produced ``update`` (wired as every ``SimWorker``'s callback)."""
        request = self.attempts.get(update.request.request_id)
        if request is None:
            return  # an attempt that failed meanwhile
        assert update.new_token_id is not None
        if update.request.prefill_only:  # by the request: the worker's role may have changed
            if not request.output_ids:
                request.cached_tokens = update.request.num_cached_tokens
            delay = self.profile.transfer_s(request.kv_bytes) + self.profile.handoff_overhead_s / 2
            self.events.after(delay, self._kv_arrived, request, request.attempt, worker,
                              update.new_token_id)
            return
        if not update.finished and request.first_token_s is not None \
                and not request.local_tokens and (request.landed == request.attempt
                                                  or self.kv_index is None):
            # a token mid-stream (most updates): all that _token does with it
            request.token_times_s.append(self.events.now)
            request.output_ids.append(update.new_token_id)
            return
        if request.first_token_s is None:  # a local attempt's first token
            request.cached_tokens = update.request.num_cached_tokens
        if request.local_tokens:
            self.shared.local_prefilled(request)
        self._token(request, update.new_token_id, update.finished)

    def _kv_arrived(self, request: SimRequest, attempt: str, prefill: SimWorker,
                    first_token: int) -> None:
        if request.attempt != attempt or prefill.dead:
            return  # the attempt failed meanwhile (and was retried or ended)
        prefill.release_pinned(attempt)
        # the Prefill's reply, once the decode side has the KV: its loads are given back
        self.inflight[prefill.worker_id] -= 1
        self.queued_tokens[prefill.worker_id] -= request.prefill_tokens
        request.prefill_worker = None  # its part is done: its death no longer matters
        decode = self._worker(request.decode_worker or "")
        wait = decode.residual_s()  # its loop notices the KV once the step in flight ends
        update = decode.admit_with_kv(attempt, first_token)
        if wait > 0:
            self.events.after(wait, self._first_token, request, attempt, first_token,
                              update.finished)
        else:
            self._token(request, first_token, update.finished)

    def _first_token(self, request: SimRequest, attempt: str, token_id: int,
                     finished: bool) -> None:
        if request.attempt == attempt:  # else it failed meanwhile
            self._token(request, token_id, finished)

    def _token(self, request: SimRequest, token_id: int, finished: bool) -> None:
        now = self.events.now
        assert request.ticket is not None
        if (request.landed != request.attempt or finished) and self.kv_index is not None \
                and request.decode_worker is not None:  # as Placement.kv_landed
            request.landed = request.attempt
            self.gate.recent.landed(request.decode_worker, self._prompt_block(request))
        if request.first_token_s is None:
            request.first_token_s = now
            request.ticket.first_token()
        request.token_times_s.append(now)
        request.output_ids.append(token_id)
        if finished:
            request.finished_s = now
            self._drop_attempt(request)
            self._end(request)

    # ------------------------------------------------------------------ faults

    def worker_died(self, dead: SimWorker) -> None:
        """``dead`` is gone: each attempt it took part in is retried, or (after its first
        token) migrated — the prompt and the tokens streamed prefilled again elsewhere —
        within ``handoff.migration_limit``; what the attempt held on the survivors is freed."""
        for request in list(self.attempts.values()):  # its prefill, or KV it was sending
            if dead.worker_id in (request.decode_worker, request.prefill_worker):
                self._retry(request)

    def _retry(self, request: SimRequest) -> None:
        """The current attempt failed: migrated if it streamed tokens (within
        ``migration_limit``), else retried (within ``max_attempts`` since the last
        migration), as the handoff's loop does."""
        self._abort_attempt(request)
        if len(request.output_ids) > request.attempt_from:
            request.migrations += 1
            request.failures = 0
            if request.migrations > self.handoff.migration_limit:
                self._fail(request, grpc.StatusCode.UNAVAILABLE,
                           f"its decode worker failed after {len(request.output_ids)} "
                           f"streamed tokens, {request.migrations - 1} migrations already")
                return
        else:
            request.failures += 1
            if request.failures >= self.handoff.max_attempts:
                self._fail(request, grpc.StatusCode.UNAVAILABLE,
                           f"the workers failed {request.failures} times before the first "
                           "token")
                return
        self.queue.appendleft(request)  # it keeps its turn
        self._capacity_changed()

    def _abort_attempt(self, request: SimRequest) -> None:
        """The current attempt's blocks freed on the live workers that hold them."""
        for worker_id in (request.prefill_worker, request.decode_worker):
            if worker_id is not None and not self._worker(worker_id).dead:
                self._worker(worker_id).abort(request.attempt)
        self._drop_attempt(request)

    def _drop_attempt(self, request: SimRequest) -> None:
        """The current attempt ends: the loads it counted are given back."""
        self.attempts.pop(request.attempt, None)
        self.shared.release(request)

    def _fail(self, request: SimRequest, code: grpc.StatusCode, details: str) -> None:
        request.error = f"{code.name}: {details}"
        self._end(request)

    def _end(self, request: SimRequest) -> None:
        self.shared.last_end_s = self.events.now
        self.unfinished -= 1
        self.shared.unfinished -= 1
        if request.ticket is not None:
            request.ticket.leave()  # capacity changed: the head tries again
