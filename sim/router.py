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
  workers, or ``router.policy.short_tail``) puts the whole request on it instead.
- Prefill: ``router.policy.choose_prefill`` — the function ``Placement`` calls.
- Shared by every router (``SharedView``): the attempts and queued prompt tokens on each
  worker (the routers' shared loads, exchanged at once here), and the KV index,
  ``router.kv_index.KVIndex``, fed every ``interval_s`` with each worker's KV events as
  ``cluster.kv_events.EventBatch``es (what the stream carries).

Costs outside the workers' steps come from the profile: ``router.overhead_s`` per request
before admission, ``handoff.overhead_s`` for the attempt's calls (before the prefill
starts, and with the KV's arrival), and the KV transfer (``Profile.transfer_s`` of the
blocks the decode worker lacks).
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

import grpc

from cluster.kv_events import EventBatch
from engine.core.request import Request
from engine.core.scheduler import StepUpdate
from engine.kvcache.block_hash import compute_block_hashes
from engine.sampling_params import SamplingParams
from engine.tp.sharding import num_blocks_for
from router.admission import RETRY_PLACEMENT_S, Admission, Ticket
from router.config import AdmissionConfig, HandoffConfig
from router.errors import RouteError
from router.kv_index import KVIndex
from router.policy import choose_prefill, short_tail
from router.routing import DecodeCandidate, affinity_key, rank_decode
from sim.events import EventQueue
from sim.profile import Profile
from sim.worker import SimWorker


@dataclass
class SimRequest:
    """One request of the workload and what became of it (times on the virtual clock)."""

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    error: str = ""  # "CODE: details" when it failed
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    cached_tokens: int = 0  # prompt tokens the prefill side's prefix cache served
    prefill_worker: str | None = None  # None: prefilled on its decode worker
    decode_worker: str | None = None
    kv_bytes: int = 0  # KV moved from prefill to decode
    ticket: Ticket | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of the current attempt's prompt
    attempt: str = ""  # the current attempt's id on the workers
    num_attempts: int = 0
    migrations: int = 0  # attempts after its first token (its decode worker died)
    prefilled: bool = False  # the current attempt's prefill is done
    output_ids: list[int] = field(default_factory=list)  # streamed so far

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def done(self) -> bool:
        return bool(self.error) or self.finished_s is not None


class SharedView:
    """What every router of the cluster knows alike: the attempts in flight and the prompt
    tokens waiting for a first token on each worker (the routers' shared loads, here
    exchanged at once: the real routers' exchange at each refresh is not modelled), and
    the KV index, fed every ``interval_s`` with each worker's KV events."""

    def __init__(self, events: EventQueue, workers: list[SimWorker], prefill_routing: str,
                 interval_s: float) -> None:
        self.events = events
        self.workers = workers
        self.inflight: Counter[str] = Counter()  # attempts on each worker
        self.queued_tokens: Counter[str] = Counter()  # prompt tokens before first token
        self.unfinished = 0  # requests arrived and not ended, on every router
        self.routers: list[SimRouter] = []
        self.owner: dict[str, SimRouter] = {}  # attempt id -> the router that made it
        self._interval = interval_s
        self._seq: Counter[str] = Counter()
        self.kv_index: KVIndex | None = None
        if prefill_routing == "kv-aware":
            self.kv_index = KVIndex(clock=events.clock)
            self.kv_index.watch(w.worker_id for w in workers)
            for w in workers:  # a fresh worker's snapshot: empty, before batch 1
                self.kv_index.load_snapshot(w.worker_id, 1, 0, [])
            self.kv_index.heard()

    def kill(self, worker_id: str) -> None:
        """Fault: ``worker_id`` dies now; every router retries or migrates what it held."""
        worker = next(w for w in self.workers if w.worker_id == worker_id)
        worker.kill()
        for router in self.routers:
            router.worker_died(worker)

    def on_output(self, worker: SimWorker, update: StepUpdate) -> None:
        """Every worker's callback: the update goes to the router of its attempt."""
        router = self.owner.get(update.request.request_id)
        if router is not None:
            router.on_output(worker, update)

    def arrived(self) -> None:
        self.unfinished += 1
        if self.unfinished == 1 and self.kv_index is not None:
            self.events.after(self._interval, self._feed)

    def _feed(self) -> None:
        """The workers' KV events since the last read, as a router's feed reads them."""
        assert self.kv_index is not None
        for worker in self.workers:
            ops = worker.kv_events.drain()
            if ops:
                self._seq[worker.worker_id] += 1
                self.kv_index.apply(EventBatch(worker.worker_id, 1, self._seq[worker.worker_id],
                                               tuple(ops)))
        self.kv_index.heard()
        if self.unfinished:
            self.events.after(self._interval, self._feed)


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
        self.prefill = [w for w in workers if w.role == "prefill"]
        self.decode = [w for w in workers if w.role == "decode"]
        self.admission = Admission(admission.max_inflight, admission.max_queued_tokens,
                                   clock=events.clock, on_capacity=self._capacity_changed)
        self.queue: deque[SimRequest] = deque()
        self.shared = shared
        shared.routers.append(self)
        self.inflight, self.queued_tokens = shared.inflight, shared.queued_tokens
        self.kv_index = shared.kv_index
        self.attempts: dict[str, SimRequest] = {}
        self.unfinished = 0
        self._turns = itertools.count()
        self._pump_pending = False
        self._retry_at: float | None = None

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
        local = h.local_prefill == "always" or (h.local_prefill == "fallback"
                                                and not self._live(self.prefill)) or (
            self.kv_index is not None and self.kv_index.trusted()
            and short_tail(h.local_prefill_max_tokens, request.prompt_len, self.block_size,
                           held.get(order[0], 0)))
        if local:
            worker = self._worker(order[0])
            self._start(request, worker)
            worker.add(self._engine_request(request, request.attempt))
            return True
        for decode_id in order:
            worker = self._worker(decode_id)
            attempt = f"{request.request_id}#{request.num_attempts}"
            reserved = worker.reserve(self._engine_request(request, attempt))
            if reserved is None:
                continue
            self._start(request, worker)
            full = num_blocks_for(len(self._sequence(request)), self.block_size)
            request.kv_bytes = (full - reserved) * self.profile.block_bytes()
            self.events.after(self.profile.handoff_overhead_s / 2, self._prefill, request,
                              request.attempt)
            return True
        return False

    def _sequence(self, request: SimRequest) -> tuple[int, ...]:
        """What the current attempt computes: the prompt, and the tokens streamed before
        (a migrated stream resumes after them)."""
        return request.prompt_token_ids + tuple(request.output_ids)

    def _engine_request(self, request: SimRequest, attempt: str) -> Request:
        return Request(attempt,
                       list(self._sequence(request)),
                       SamplingParams(max_tokens=request.max_tokens, ignore_eos=True,
                                      temperature=0.0),
                       num_resumed_tokens=len(request.output_ids))

    def _start(self, request: SimRequest, decode: SimWorker) -> None:
        assert request.ticket is not None
        request.ticket.placed()
        request.attempt = f"{request.request_id}#{request.num_attempts}"
        request.num_attempts += 1
        request.prefilled = False
        request.decode_worker = decode.worker_id
        self.inflight[decode.worker_id] += 1
        self.attempts[request.attempt] = request
        self.shared.owner[request.attempt] = self

    def _decode_order(self, request: SimRequest) -> tuple[list[str], dict[str, int]]:
        live = self._live(self.decode)
        held = self._cached(request, [w.worker_id for w in live])
        candidates = [DecodeCandidate(w.worker_id, self.inflight[w.worker_id],
                                      w.blocks.usage().num_allocatable, w.blocks.num_blocks,
                                      held.get(w.worker_id, 0)) for w in live]
        return rank_decode(candidates, self._num_blocks(request),
                           self.handoff.load_epsilon), held

    def _prefill(self, request: SimRequest, attempt: str) -> None:
        if request.attempt != attempt:  # the attempt failed meanwhile
            return
        loads = {w.worker_id: self.inflight[w.worker_id] for w in self._live(self.prefill)}
        if not loads:  # every prefill worker died after the reservation
            self._retry(request)
            return
        mode = self.handoff.prefill_routing
        trusted = self.kv_index is not None and self.kv_index.trusted()
        choice = choose_prefill(
            mode, key=affinity_key(request.block_hashes, request.prompt_token_ids,
                                   self.handoff.affinity_blocks),
            loads=loads, queued_tokens=self.queued_tokens if trusted else {},
            num_prompt_tokens=request.prompt_len, block_size=self.block_size,
            cached=self._cached(request, list(loads)) if trusted else None,
            turn=next(self._turns) if mode == "round-robin" else 0,
            epsilon=self.handoff.load_epsilon)
        worker = self._worker(choice.order[0])
        request.prefill_worker = worker.worker_id
        self.inflight[worker.worker_id] += 1
        self.queued_tokens[worker.worker_id] += len(self._sequence(request))
        worker.add(Request(request.attempt, list(self._sequence(request)),
                           SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True))

    def _cached(self, request: SimRequest, worker_ids: list[str]) -> dict[str, int]:
        index = self.kv_index
        if index is None or not index.trusted():
            return {}
        return index.match(request.block_hashes, worker_ids)

    def _num_blocks(self, request: SimRequest) -> int:
        return num_blocks_for(request.prompt_len + request.max_tokens, self.block_size)

    def _worker(self, worker_id: str) -> SimWorker:
        return self._by_id[worker_id]

    @staticmethod
    def _live(workers: list[SimWorker]) -> list[SimWorker]:
        return [w for w in workers if not w.dead]

    # ------------------------------------------------------------------ outputs

    def on_output(self, worker: SimWorker, update: StepUpdate) -> None:
        """A worker's step produced ``update`` (wired as every ``SimWorker``'s callback)."""
        request = self.attempts.get(update.request.request_id)
        if request is None:
            return  # an attempt that failed meanwhile
        assert update.new_token_id is not None
        if worker.role == "prefill":
            self.inflight[worker.worker_id] -= 1
            self.queued_tokens[worker.worker_id] -= update.request.num_prompt_tokens
            request.prefilled = True
            if not request.output_ids:
                request.cached_tokens = update.request.num_cached_tokens
            delay = self.profile.transfer_s(request.kv_bytes) + self.profile.handoff_overhead_s / 2
            self.events.after(delay, self._kv_arrived, request, request.attempt, worker,
                              update.new_token_id)
            return
        if request.first_token_s is None:  # a local attempt's first token
            request.cached_tokens = update.request.num_cached_tokens
        self._token(request, update.new_token_id, update.finished)

    def _kv_arrived(self, request: SimRequest, attempt: str, prefill: SimWorker,
                    first_token: int) -> None:
        if request.attempt != attempt or prefill.dead:
            return  # the attempt failed meanwhile (and was retried or ended)
        prefill.release_pinned(attempt)
        decode = self._worker(request.decode_worker or "")
        update = decode.admit_with_kv(attempt, first_token)
        self._token(request, first_token, update.finished)

    def _token(self, request: SimRequest, token_id: int, finished: bool) -> None:
        now = self.events.now
        assert request.ticket is not None
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
        for request in list(self.attempts.values()):
            if request.decode_worker == dead.worker_id or (
                    request.prefill_worker == dead.worker_id and not request.prefilled):
                self._retry(request)

    def _retry(self, request: SimRequest) -> None:
        for worker_id in (request.prefill_worker, request.decode_worker):
            if worker_id is not None and not self._worker(worker_id).dead:
                self._worker(worker_id).abort(request.attempt)
        self._drop_attempt(request)
        if request.first_token_s is not None:
            request.migrations += 1
            if request.migrations > self.handoff.migration_limit:
                self._fail(request, grpc.StatusCode.UNAVAILABLE,
                           f"its decode worker failed after {len(request.output_ids)} "
                           f"streamed tokens, {request.migrations - 1} migrations already")
                return
        request.block_hashes = compute_block_hashes(self._sequence(request), self.block_size)
        self.queue.appendleft(request)  # it keeps its turn
        self._capacity_changed()

    def _drop_attempt(self, request: SimRequest) -> None:
        """The current attempt ends: the loads it counted are given back."""
        if request.prefill_worker is not None and not request.prefilled:
            self.inflight[request.prefill_worker] -= 1
            self.queued_tokens[request.prefill_worker] -= len(self._sequence(request))
        if request.decode_worker is not None:
            self.inflight[request.decode_worker] -= 1
        self.attempts.pop(request.attempt, None)
        self.shared.owner.pop(request.attempt, None)
        request.prefill_worker = request.decode_worker = None
        request.attempt = ""

    def _fail(self, request: SimRequest, code: grpc.StatusCode, details: str) -> None:
        request.error = f"{code.name}: {details}"
        self._end(request)

    def _end(self, request: SimRequest) -> None:
        self.unfinished -= 1
        self.shared.unfinished -= 1
        if request.ticket is not None:
            request.ticket.leave()  # capacity changed: the head tries again
