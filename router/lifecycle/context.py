"""``RequestContext``: what every room of one request's lifecycle reads and shares — the
request, its deadline, the workers that failed it, its calls, its trace — and the one
reading of a failed worker call in the request's terms."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cluster.leases import LeaseKeeper
from router.admission import Ticket
from router.config import HandoffConfig
from router.errors import RouteError
from router.kv_index import KVIndex
from router.lifecycle.outcomes import MoveOffer
from router.metrics import RouterMetrics
from router.trace import Trace
from router.validation import ValidRequest
from router.worker_calls import CallFailure, Failure, WorkerCalls, classify
from router.workers import WorkerPool

logger = logging.getLogger("router.lifecycle")


@dataclass
class SharedDecode:
    """The decode worker the choices of one request (n > 1) share: choice 0's attempt
    names it (its latest), and the later choices prefill there locally (unless it failed
    them or left routing): its prefix cache holds their prompt but for the last token's
    block, which it computes, so the prompt's KV travels once and the prefill worker
    computes it once."""

    worker_id: str | None = None


@dataclass
class RequestContext:
    """One request's shared state (the event loop's; one request, its lifecycle's rooms).

    ``excluded`` holds the workers that failed this request (never asked again for it);
    ``background`` keeps a task alive until it ends (Aborts sent while the request's own
    task may be cancelled); ``shared_decode``, the decode worker of the request's sibling
    choices (n > 1), and ``choice`` the request's index among them."""

    pool: WorkerPool
    request: ValidRequest
    ticket: Ticket
    deadline: float
    config: HandoffConfig
    metrics: RouterMetrics
    leases: LeaseKeeper
    calls: WorkerCalls
    background: Callable[[asyncio.Future[object]], None]
    trace: Trace
    block_size: int
    hash_seed: int
    clock: Callable[[], float] = time.monotonic
    excluded: set[str] = field(default_factory=set)
    shared_decode: SharedDecode | None = None
    choice: int = 0
    kv_index: KVIndex | None = None  # where the workers' KV is (kv-aware routing)
    # the prefix-cache salt of KV a decode worker receives (lossy wire: keyed apart there)
    received_kv_salt: str = ""
    # a draining decode worker's offer, for the next attempt's Prefill (router.lifecycle.prefill)
    pending_move: MoveOffer | None = None
    # why the next attempt prefills on its decode worker, set by a ``QueueRefused``
    local_reason: str | None = None
    log: logging.LoggerAdapter = field(init=False)

    def __post_init__(self) -> None:
        self.log = logging.LoggerAdapter(logger, {"request_id": self.request.request_id})

    @property
    def client_request_id(self) -> str:
        return self.request.request_id

    def timeout(self, cap_s: float | None = None) -> float:
        """Seconds left to the deadline (at most ``cap_s``); DEADLINE_EXCEEDED once passed."""
        remaining = self.deadline - self.clock()
        if remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        return remaining if cap_s is None else min(remaining, cap_s)

    def failure(self, exc: grpc.aio.AioRpcError) -> CallFailure:
        """What a failed worker call means for this request."""
        return classify(exc, deadline_passed=self.clock() >= self.deadline)

    @staticmethod
    def check_deadline(failure: CallFailure) -> None:
        if failure.kind is Failure.DEADLINE:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             "the request's deadline passed while the workers were serving it")

    def worker_failed(self, worker_id: str, failure: CallFailure) -> None:
        """The worker failed this request: never asked again for it, and skipped by
        everyone for a while when it failed in transport."""
        self.excluded.add(worker_id)
        if failure.unreachable:
            self.pool.mark_failed(worker_id, str(failure))

    def id_in_use(self, where: str) -> RouteError:
        """A worker holds this attempt's id already: attempt ids are unique per router and
        random across routers, so this is a bug, not the client's doing."""
        return RouteError(grpc.StatusCode.INTERNAL,
                          f"an attempt id of request {self.client_request_id!r} is already "
                          f"held{where} (attempt ids must be unique)")
