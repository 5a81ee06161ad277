"""What the simulated routers keep: each request's fate (``SimRequest``) and what every
router knows alike (``SharedView``: the loads on each worker and the KV index)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from cluster.kv_events import EventBatch
from engine.core.request import Request
from engine.core.scheduler import StepUpdate
from engine.sampling_params import SamplingParams
from router.admission import Ticket
from router.kv_index import KVIndex
from sim.events import EventQueue
from sim.worker import SimWorker


class RouterSide(Protocol):
    """What ``SharedView`` calls on each router (``sim.router.SimRouter``)."""

    def worker_died(self, dead: SimWorker) -> None: ...

    def on_output(self, worker: SimWorker, update: StepUpdate) -> None: ...


def live(workers: list[SimWorker]) -> list[SimWorker]:
    """Those of ``workers`` not killed."""
    return [w for w in workers if not w.dead]


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
    prefill_worker: str | None = None  # None: prefilled on its decode worker, or KV arrived
    prefill_tokens: int = 0  # what its prefill adds to that worker's queued tokens
    decode_worker: str | None = None
    kv_bytes: int = 0  # KV moved from prefill to decode
    ticket: Ticket | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of its prompt (as the router's)
    attempt: str = ""  # the current attempt's id on the workers
    num_attempts: int = 0
    migrations: int = 0  # attempts after its first token (its decode worker died)
    attempt_from: int = 0  # tokens streamed when the current attempt started
    failures: int = 0  # attempts failed before their first token since the last migration
    turn: int | None = None  # its round-robin turn, drawn once (as Placement's)
    no_ahead: bool = False  # a Reserve its Prefill went out with was refused
    landed: str = ""  # the attempt whose KV was last seen landing (router.recent_kv)
    output_ids: list[int] = field(default_factory=list)  # streamed so far
    local_tokens: int = 0  # its local attempt's prompt tokens, until its first token
    remote_attempt: int = -1  # the attempt conditional disaggregation sent to a Reserve

    def sequence(self) -> tuple[int, ...]:
        """What its current attempt computes: the prompt, and the tokens streamed before
        (a migrated stream resumes after them)."""
        return self.prompt_token_ids + tuple(self.output_ids)

    def engine_request(self, attempt: str, prefill_only: bool = False) -> Request:
        """Its current attempt as a worker's engine sees it (the prompt's block hashes
        given: the engine's own, seed 0 and no salt, extended past them as it goes)."""
        request = Request(attempt, list(self.sequence()),
                          SamplingParams(max_tokens=1 if prefill_only else self.max_tokens,
                                         ignore_eos=True, temperature=0.0),
                          num_resumed_tokens=0 if prefill_only else len(self.output_ids),
                          prefill_only=prefill_only)
        request.block_hashes = list(self.block_hashes)
        return request

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def done(self) -> bool:
        return bool(self.error) or self.finished_s is not None


class SharedView:
    """What every router of the cluster knows alike: the attempts in flight and the prompt
    tokens queued prefills will compute on each worker (the routers' shared loads, here
    exchanged at once: the real routers' exchange at each refresh is not modelled, nor
    the prefill workers' queue refusals that correct its lag, ``cluster.prefill_queue``), and
    the KV index, fed every ``interval_s`` with each worker's KV events."""

    def __init__(self, events: EventQueue, workers: list[SimWorker], prefill_routing: str,
                 interval_s: float) -> None:
        self.events = events
        self.workers = workers
        self.inflight: Counter[str] = Counter()  # attempts on each worker
        self.queued_tokens: Counter[str] = Counter()  # uncached tokens of queued prefills
        self.unfinished = 0  # requests arrived and not ended, on every router
        self.routers: list[RouterSide] = []
        self.owner: dict[str, RouterSide] = {}  # attempt id -> the router that made it
        self._interval = interval_s
        self._seq: Counter[str] = Counter()
        self._feeding = False  # a read of the KV events is due
        self.last_end_s: float | None = None  # when the last request ended
        self.kv_index: KVIndex | None = None
        if prefill_routing == "kv-aware":
            self.kv_index = KVIndex(clock=events.clock)
            self.kv_index.watch(w.worker_id for w in workers)
            for w in workers:  # a fresh worker's snapshot: empty, before batch 1
                self.kv_index.load_snapshot(w.worker_id, 1, 0, [])
            self.kv_index.heard()

    def add_worker(self, worker: SimWorker) -> None:
        """A worker the planner added (``workers`` already holds it): the KV index hears
        of it as of a fresh worker's empty snapshot."""
        if self.kv_index is not None:
            self.kv_index.watch([worker.worker_id])
            self.kv_index.load_snapshot(worker.worker_id, 1, 0, [])

    def kill(self, worker_id: str) -> None:
        """Fault: ``worker_id`` dies now; every router retries or migrates what it held."""
        worker = next(w for w in self.workers if w.worker_id == worker_id)
        worker.kill()
        for router in self.routers:
            router.worker_died(worker)

    def on_outputs(self, worker: SimWorker, updates: list[StepUpdate]) -> None:
        """Every worker's callback, once a step: each update goes to the router of its
        attempt."""
        owner = self.owner.get
        for update in updates:
            router = owner(update.request.request_id)
            if router is not None:
                router.on_output(worker, update)

    def cached(self, request: SimRequest, worker_ids: list[str]) -> dict[str, int]:
        """Leading blocks of ``request``'s prompt each worker holds (the KV index's word;
        none known without a trusted one)."""
        index = self.kv_index
        if index is None or not index.trusted():
            return {}
        return index.match(request.block_hashes, worker_ids)

    def local_prefilled(self, request: SimRequest) -> None:
        """``request``'s local attempt computed its prompt (its first token came, or it
        ended): its tokens no longer count on its decode worker."""
        if request.local_tokens and request.decode_worker is not None:
            self.queued_tokens[request.decode_worker] -= request.local_tokens
        request.local_tokens = 0

    def release(self, request: SimRequest) -> None:
        """``request``'s current attempt ended: the loads it counted are given back."""
        self.local_prefilled(request)
        if request.prefill_worker is not None:  # its Prefill had not returned
            self.inflight[request.prefill_worker] -= 1
            self.queued_tokens[request.prefill_worker] -= request.prefill_tokens
        if request.decode_worker is not None:
            self.inflight[request.decode_worker] -= 1
        self.owner.pop(request.attempt, None)
        request.prefill_worker = request.decode_worker = None
        request.attempt = ""

    def arrived(self) -> None:
        self.unfinished += 1
        if self.kv_index is not None and not self._feeding:
            # the feed stops while nothing is in flight (so that the run can end); a real
            # router's reads went on meanwhile: its index is as current as the workers'
            self._feeding = True
            self.kv_index.heard()
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
        self._feeding = bool(self.unfinished)
        if self._feeding:
            self.events.after(self._interval, self._feed)
