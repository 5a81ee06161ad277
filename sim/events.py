"""The simulator's virtual clock: an event queue of callbacks by time.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a run is a deterministic function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any

PROGRESS_S = 10.0  # wall seconds between progress calls
PROGRESS_CHECK_EVENTS = 20_000  # events between looks at the wall clock


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

    def run(self, until: float | None = None, *, progress: Callable[[], None] | None = None,
            progress_s: float | None = None) -> None:
        """Runs events until none is left (or the next is past ``until``); ``progress``, if
        given, is called between events about every ``progress_s`` seconds of wall time
        (default ``PROGRESS_S``: a long run's progress output; it changes nothing in the
        run)."""
        if progress is None:
            self._run_some(until, sys.maxsize)
            return
        interval = PROGRESS_S if progress_s is None else progress_s
        next_s = time.perf_counter() + interval
        while self._run_some(until, PROGRESS_CHECK_EVENTS):
            if time.perf_counter() >= next_s:
                progress()
                next_s = time.perf_counter() + interval

    def _run_some(self, until: float | None, count: int) -> bool:
        """Runs at most ``count`` events; whether any is left to run."""
        queue = self._queue
        for _ in range(count):
            if not queue or (until is not None and queue[0][0] > until):
                return False
            t, _, fn, args = heapq.heappop(queue)
            self.now = t
            self.num_events += 1
            fn(*args)
        return True

    def __len__(self) -> int:
        return len(self._queue)
