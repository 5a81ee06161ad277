"""``OutputStream``: one request's results, from the engine-loop thread to the one asyncio
task that awaits them (``worker.loop``'s threading model)."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Generic, TypeVar

import grpc

from worker.commands import WorkerError

T = TypeVar("T")


class OutputStream(Generic[T]):
    """One request's results, written by the loop thread, awaited by one asyncio task.

    Made on the reader's event loop (the loop thread wakes the reader through it). Bounded
    by construction: the loop puts at most ``capacity`` items (one per token plus the
    end; set at construction or by ``bound``), so ``put`` never waits; a put beyond it is
    a bug and raises. The end of the
    stream is an item for which the reader's own check says so, or a ``WorkerError``
    (put with ``fail``). Items for a reader whose event loop closed are dropped.
    ``ready()`` takes, without waiting, the items that arrived meanwhile (a reader that
    fell behind sends them as one message). ``wait_taken`` lets the loop thread wait,
    bounded, until the reader has taken everything put and asks for more (it has handed
    on what it took).
    """

    def __init__(self, capacity: int | None = None) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._items: deque[T | WorkerError] = deque()  # the event loop's thread only
        self._waiter: asyncio.Future[None] | None = None
        self._capacity = capacity
        self._num_put = 0  # loop thread only
        # monotonic, set by the loop: when what the request waited on outside this worker
        # arrived (a decode stream opened before its KV: the KV's arrival); None: nothing
        self.inputs_arrived_at: float | None = None
        self._reader_waits = threading.Event()  # set: the reader took all and awaits more

    def bound(self, capacity: int) -> None:
        """Set the capacity (the loop thread, when it learns how many items there can be)."""
        self._capacity = capacity

    def put(self, item: T) -> None:
        if self._capacity is not None and self._num_put >= self._capacity:
            raise RuntimeError(f"more than {self._capacity} items for one request")
        self._num_put += 1
        self._reader_waits.clear()
        self._deliver(item)

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        self._deliver(WorkerError(code, message))

    def _deliver(self, item: T | WorkerError) -> None:
        try:
            self._event_loop.call_soon_threadsafe(self._arrived, item)
        except RuntimeError:  # the reader's event loop is closed: nobody reads any more
            pass

    def _arrived(self, item: T | WorkerError) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, timeout_s: float | None) -> T:
        """The next item; raises the ``WorkerError`` put by ``fail``, or
        ``WorkerError(DEADLINE_EXCEEDED)`` after ``timeout_s``."""
        if not self._items:
            self._reader_waits.set()
            self._waiter = self._event_loop.create_future()
            try:
                await asyncio.wait_for(self._waiter, timeout_s)
            except TimeoutError:
                raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "deadline exceeded") from None
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, WorkerError):
            raise item
        return item

    def wait_taken(self, timeout_s: float) -> bool:
        """(Another thread.) Wait up to ``timeout_s`` for the reader to have taken every
        item put and be awaiting the next; whether it was."""
        return self._reader_waits.wait(timeout_s)

    def ready(self) -> list[T]:
        """The items already here, in order, without waiting; a failure stays for ``get``."""
        taken: list[T] = []
        while self._items and not isinstance(self._items[0], WorkerError):
            taken.append(self._items.popleft())  # type: ignore[arg-type]
        return taken
