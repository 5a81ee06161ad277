"""Admission: the router's budgets and its first-come-first-served queue (torch-free).

A request is admitted at once or refused at once: ``Admission.enter`` counts it against
``max_inflight`` (requests queued and running together) and ``max_queued_tokens`` (prompt
tokens of requests that have no first token yet; one request alone is always admitted)
and refuses it with RESOURCE_EXHAUSTED, naming the limit, past either. An admitted request
then waits its turn (``Ticket.turn``): one request at a time — the oldest — may place
itself on the workers; it keeps its turn while no worker can take it (it waits on
``capacity_changed``, with its deadline), so a busy cluster queues instead of failing,
and nobody overtakes it. A request whose deadline passes while queued is
DEADLINE_EXCEEDED before any worker did anything for it.

``Ticket`` is one admitted request's handle: ``first_token()`` gives back its queued
tokens, ``leave()`` everything (idempotent). Everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from router.errors import RouteError

RETRY_PLACEMENT_S = 0.1  # a waiting head retries at least this often (others free blocks too)


@dataclass
class Ticket:
    """One admitted request (see module doc)."""

    admission: Admission
    request_id: str
    queued_tokens: int
    admitted_at: float
    placed_at: float | None = None  # when it got its turn and workers took it
    _left: bool = False

    @property
    def queue_s(self) -> float:
        """Seconds it waited in the router's queue (so far, while it waits)."""
        end = self.placed_at if self.placed_at is not None else self.admission.clock()
        return end - self.admitted_at

    @asynccontextmanager
    async def turn(self, deadline: float) -> AsyncIterator[None]:
        """Wait to be the oldest request trying to place itself (FIFO), at most until
        ``deadline`` (then DEADLINE_EXCEEDED); the turn passes on when the block exits."""
        await self.admission.wait_turn(deadline)
        try:
            yield
        finally:
            self.admission.pass_turn()

    def placed(self) -> None:
        """A worker took it: it is running, no longer queued."""
        if self.placed_at is None:
            self.placed_at = self.admission.clock()

    def first_token(self) -> None:
        """Its first token reached the client: its prompt tokens no longer count."""
        self.admission.queued_tokens -= self.queued_tokens
        self.queued_tokens = 0

    def leave(self) -> None:
        if self._left:
            return
        self._left = True
        self.first_token()
        self.admission.inflight -= 1
        ids = self.admission.live_ids
        ids[self.request_id] -= 1
        if ids[self.request_id] <= 0:
            del ids[self.request_id]
        self.admission.notify_capacity()


class Admission:
    """One router's budgets, its FIFO turn and its capacity signal (see module doc)."""

    def __init__(self, max_inflight: int, max_queued_tokens: int | None, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_capacity: Callable[[], None] | None = None) -> None:
        self.max_inflight = max_inflight
        self.max_queued_tokens = max_queued_tokens
        self.clock = clock
        # what "capacity may have changed" does: wake the waiting head on the event loop
        # (the simulator, ``sim``, drives the same budgets on its virtual clock instead)
        self._on_capacity = on_capacity
        self.inflight = 0
        self.queued_tokens = 0
        # client request ids in flight, with how many requests carry each: clients may
        # reuse an id (a cancel-and-resubmit); every attempt has its own id on the workers
        self.live_ids: Counter[str] = Counter()
        self._turn = asyncio.Lock()  # FIFO: waiters are woken in arrival order
        self._capacity = asyncio.Condition()
        self.num_waiting = 0  # queued for their turn (the one holding it not counted)

    def check(self, num_tokens: int, *, upper_bound: bool = False) -> None:
        """RESOURCE_EXHAUSTED when a request of ``num_tokens`` could not be admitted now;
        cheap, before the router tokenizes anything. ``upper_bound``: ``num_tokens`` may
        be far more than the prompt's tokens (its bytes, say), so the queued tokens refuse
        it only when they leave no room at all (``enter`` checks the real count)."""
        if self.inflight >= self.max_inflight:
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self.inflight} requests queued or running, the router's limit "
                             f"(--max-inflight {self.max_inflight}); retry later", "max_inflight")
        limit = self.max_queued_tokens
        if upper_bound:
            num_tokens = 1
        if limit is not None and self.queued_tokens and self.queued_tokens + num_tokens > limit:
            raise RouteError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{self.queued_tokens} prompt tokens wait for their first token; "
                             f"{num_tokens} more would pass the router's limit "
                             f"(--max-queued-tokens {limit}); retry later", "max_queued_tokens")

    def enter(self, request_id: str, num_tokens: int) -> Ticket:
        """Admit a validated request of ``num_tokens`` prompt tokens, or refuse it at once
        (RESOURCE_EXHAUSTED over a budget). A request id already in flight is no reason to
        refuse: the workers never see client ids as keys (``router.lifecycle``)."""
        self.check(num_tokens)
        self.inflight += 1
        self.queued_tokens += num_tokens
        self.live_ids[request_id] += 1
        return Ticket(self, request_id, num_tokens, self.clock())

    async def wait_turn(self, deadline: float) -> None:
        self.num_waiting += 1
        try:  # asyncio.timeout, not wait_for: on 3.11 that can swallow a cancel
            async with asyncio.timeout(max(0.0, deadline - self.clock())):
                await self._turn.acquire()
        except TimeoutError:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             "the request's deadline passed while it waited in the router's "
                             f"queue ({self.num_waiting} waiting)") from None
        finally:
            self.num_waiting -= 1

    def pass_turn(self) -> None:
        self._turn.release()

    def notify_capacity(self) -> None:
        """Something that holds worker capacity ended: a waiting head should try again."""
        if self._on_capacity is not None:
            self._on_capacity()
            return
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    async def capacity_changed(self, deadline: float) -> None:
        """Wait until capacity may have changed (or ``RETRY_PLACEMENT_S``); DEADLINE_EXCEEDED
        once ``deadline`` passed."""
        remaining = deadline - self.clock()
        if remaining <= 0:
            raise RouteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             "the request's deadline passed while no worker could take it")
        async with self._capacity:
            try:
                async with asyncio.timeout(min(RETRY_PLACEMENT_S, remaining)):
                    await self._capacity.wait()
            except TimeoutError:
                pass
