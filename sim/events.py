"""The simulator's virtual clock: an event queue of callbacks by time.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a run is a deterministic function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventQueue:
    """``at(t, fn, *args)`` / ``after(dt, fn, *args)`` schedule; ``run()`` runs them in
    time order, moving ``now`` forward; ``clock`` is ``now`` as a callable (for the
    real code's injectable clocks)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        if t < self.now:
            raise ValueError(f"an event at {t} is in the past (now {self.now})")
        heapq.heappush(self._queue, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + max(0.0, dt), fn, *args)

    def run(self, until: float | None = None) -> None:
        """Runs events until none is left (or the next is past ``until``)."""
        queue = self._queue
        while queue and (until is None or queue[0][0] <= until):
            t, _, fn, args = heapq.heappop(queue)
            self.now = t
            self.num_events += 1
            fn(*args)

    def __len__(self) -> int:
        return len(self._queue)
