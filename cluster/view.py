"""The router's view of the live workers, last-known-good across Redis outages (torch-free).

``WorkerView`` reads the records that workers' heartbeats (``cluster.heartbeat``) keep in
Redis; when Redis fails it keeps the previous view and reports it stale. Given the model
it serves, it pins the cluster fingerprint (see ``WorkerView``).
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
from engine.kvcache.layout import PROTOCOL_VERSION, KVLayout

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

    With ``model_fingerprint`` (the router's model) it pins the cluster fingerprint: the
    first one it reads that names this model and this process's ``PROTOCOL_VERSION``
    becomes ``pinned``, and from then on every
    refresh re-asserts it (``Registry.assert_fingerprint``) before listing. So after Redis
    lost its data, a worker of another model or layout that registers first holds the
    fingerprint for one refresh at most: the workers that match the pinned layout are
    listed again and keep registering, the other one finds the mismatch at its next
    beats and exits (``cluster.heartbeat``). Until it pinned one, it never writes.
    """

    def __init__(self, registry: Registry, *, clock: Callable[[], float] = time.monotonic,
                 model_fingerprint: str | None = None) -> None:
        self._registry = registry
        self._clock = clock
        self._model_fingerprint = model_fingerprint
        self._snapshot = ViewSnapshot()
        self.pinned: KVLayout | None = None
        self.reasserted = 0  # refreshes that found another (or no) fingerprint and fixed it
        self._foreign_logged: KVLayout | None = None

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
            self._pin()
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

    def _pin(self) -> None:
        """Pin the cluster fingerprint of our model, or re-assert the pinned one."""
        if self._model_fingerprint is None:
            return
        if self.pinned is None:
            layout = self._registry.cluster_layout()
            if layout is None:
                return
            if (layout.model_fingerprint, layout.protocol_version) != \
                    (self._model_fingerprint, PROTOCOL_VERSION):
                if layout != self._foreign_logged:
                    self._foreign_logged = layout
                    logger.error("the cluster fingerprint names model %s, protocol %d, not "
                                 "ours (%s, protocol %d): workers of our model cannot join "
                                 "until it is fixed", layout.model_fingerprint,
                                 layout.protocol_version, self._model_fingerprint,
                                 PROTOCOL_VERSION)
                return
            self.pinned = layout
            logger.info("pinned the cluster fingerprint (model %s, %s, block size %d, "
                        "protocol %d)", layout.model_fingerprint, layout.dtype,
                        layout.block_size, layout.protocol_version)
            return
        replaced = self._registry.assert_fingerprint(self.pinned)
        if replaced is not None:
            self.reasserted += 1
            log = logger.info if replaced == "missing" else logger.warning
            log("re-asserted the cluster fingerprint (it was %s)",
                replaced if replaced in ("missing", "malformed")
                else f"another layout: {replaced}")
