"""The router's view of the live workers, last-known-good across Redis outages (torch-free).

``WorkerView`` reads the records that workers' heartbeats (``cluster.heartbeat``) keep in
Redis; when Redis fails it keeps the previous view and reports it stale.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.records import WorkerRecord
from cluster.registry import Registry, RegistryError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ViewSnapshot:
    """An immutable view of the workers; ``stale`` when the last refresh failed."""

    workers: tuple[WorkerRecord, ...] = ()
    refreshed_at: float | None = None  # clock() of the last successful read; None: never
    stale: bool = True
    error: str | None = None

    def of_role(self, role: str) -> tuple[WorkerRecord, ...]:
        return tuple(w for w in self.workers if w.role == role)


class WorkerView:
    """The router's last-known-good view of the workers.

    ``refresh()`` reads Redis; when Redis fails (unreachable, timed out, auth) it keeps the
    previous workers, marks the view stale and returns — it never raises for Redis errors.
    Readers on other threads see one immutable ``ViewSnapshot`` at a time.
    """

    def __init__(self, registry: Registry, *, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._registry = registry
        self._clock = clock
        self._snapshot = ViewSnapshot()

    @property
    def snapshot(self) -> ViewSnapshot:
        return self._snapshot

    @property
    def stale(self) -> bool:
        return self._snapshot.stale

    def age_s(self) -> float:
        """Seconds since the last successful refresh (``inf`` if none succeeded)."""
        refreshed_at = self._snapshot.refreshed_at
        return math.inf if refreshed_at is None else self._clock() - refreshed_at

    def workers(self, role: str | None = None) -> tuple[WorkerRecord, ...]:
        snapshot = self._snapshot
        return snapshot.workers if role is None else snapshot.of_role(role)

    def refresh(self) -> ViewSnapshot:
        try:
            workers = tuple(self._registry.list_workers())
        except RegistryError as exc:
            previous = self._snapshot
            if not previous.stale or previous.error != str(exc):
                logger.warning("keeping the last-known-good view of %d workers: %s",
                               len(previous.workers), exc)
            self._snapshot = dataclasses.replace(previous, stale=True, error=str(exc))
        else:
            if self._snapshot.stale and self._snapshot.error is not None:
                logger.info("worker view fresh again (%d workers)", len(workers))
            self._snapshot = ViewSnapshot(workers, self._clock(), stale=False)
        return self._snapshot
