"""How an attempt ends short of the client's error: ``Retry`` (it failed before any token
reached the client; another attempt may succeed), ``Busy`` (a worker was at a limit:
wait for capacity, then try again; the worker is not suspected, the attempt not spent),
``QueueRefused`` (a prefill worker's queue was longer than the decode worker's own
prefill would take: place again, prefilling there) and ``Migrate`` (its decode worker failed after tokens reached the client: the stream
may continue on another one). A failure the client sees is a ``router.errors.RouteError``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class Retry(Exception):
    """This attempt failed before any token reached the client; another may succeed.
    ``cause``: reserve, prefill, generate, worker_left, health or no_prefill (metrics)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class Busy(Exception):
    """A worker answered "busy" (RESOURCE_EXHAUSTED) before any token reached the client:
    wait for capacity and try again; the worker is not suspected, the attempt not spent."""


class QueueRefused(Exception):
    """The prefill worker refused the attempt's Prefill: it has more prompt tokens to
    compute than the router's limit (``cluster.prefill_queue``); or (``by_router``) the
    router found no prefill worker worth asking. The next attempt prefills on a decode
    worker; no worker is suspected, no attempt spent."""

    def __init__(self, message: str, by_router: bool = False) -> None:
        super().__init__(message)
        self.by_router = by_router


class Migrate(Exception):
    """The decode worker failed this attempt after ``num_streamed`` of its tokens reached
    the client; the stream may continue elsewhere. ``cause``: died, health, draining or
    ended (metrics); ``detail`` names the worker (for logs, never the client). ``move``:
    the draining worker parked the request with its KV and offers to move it
    (``cluster.moves``)."""

    def __init__(self, message: str, cause: str, num_streamed: int, detail: str,
                 move: MoveOffer | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.num_streamed = num_streamed
        self.detail = detail
        self.move = move


@dataclass(frozen=True)
class MoveOffer:
    """A draining decode worker's offer: ``worker_id`` holds the KV of ``attempt_id``'s
    request, parked, for the next attempt's Prefill to move (``cluster.moves``)."""

    worker_id: str
    attempt_id: str


def reraise_if_we_are_cancelled() -> None:
    """Inside ``except CancelledError``: re-raise when this task itself is being cancelled
    (client cancel, deadline); return when only the worker call was (``WorkerPool.watched``)."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        raise  # noqa: PLE0704 -- re-raises the CancelledError being handled
