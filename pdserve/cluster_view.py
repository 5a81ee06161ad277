"""The live cluster view: workers' heartbeats keep their records in Redis; the router reads them.

``Heartbeat`` runs inside a worker and re-registers it every ``Registry.heartbeat_s``;
``WorkerView`` is the router's last-known-good list of the live workers. Both build on a
``Registry`` (keys, record format, Redis errors: see ``pdserve.registry``) and survive Redis
outages: ``Heartbeat`` logs and retries on its next beat; ``WorkerView`` keeps its last view
and reports it stale. Torch-free, like ``pdserve.registry``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from pdserve.registry import (
    FingerprintMismatch,
    Registry,
    RegistryError,
    WorkerLoad,
    WorkerRecord,
)

logger = logging.getLogger(__name__)

class Heartbeat:
    """Keeps one worker's record in Redis; owned by that worker (a daemon thread).

    ``start()`` registers once synchronously — raising ``FingerprintMismatch`` (the worker
    must exit, naming ``exc.field``), ``RegistryUnavailable`` or ``RegistryAuthError`` — and
    then re-registers every ``registry.heartbeat_s`` with fresh figures from ``load_fn``.
    Each beat re-claims the fingerprint and re-SETs the record with its TTL, so a restarted
    Redis is refilled within one beat. A failing beat (Redis down, ``load_fn`` raising) is
    logged once per outage and retried on the next beat; the thread never dies of it.
    ``stop()`` ends the thread and, by default, deletes the key (graceful shutdown).
    """

    def __init__(self, registry: Registry, record: WorkerRecord,
                 load_fn: Callable[[], WorkerLoad] | None = None) -> None:
        self._registry = registry
        self._record = record
        self._load_fn = load_fn
        self._lock = threading.Lock()  # held while writing; stop() takes it to delete
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0
        self.failures = 0
        self.last_error: str | None = None

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Heartbeat:
        if self._thread is not None or self._stopping.is_set():
            raise RuntimeError("a Heartbeat starts once")
        self._write(self._current_record())
        self.beats += 1
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pdserve-heartbeat-{self._record.worker_id}")
        self._thread.start()
        return self

    def beat(self) -> bool:
        """One beat now; True when the record was written. Never raises for Redis errors."""
        try:
            if not self._write(self._current_record()):
                return False
        except Exception as exc:  # a beat must not kill the thread: log, retry next beat
            self._failed(exc)
            return False
        if self.last_error is not None:
            logger.info("heartbeat of %s: registered again after: %s",
                        self._record.worker_id, self.last_error)
            self.last_error = None
        self.beats += 1
        return True

    def stop(self, *, deregister: bool = True, timeout_s: float = 10.0) -> None:
        """Stop beating; with ``deregister`` delete the key (else it expires after the TTL).

        Idempotent. A Redis outage during the delete is logged, not raised.
        """
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if not deregister:
            return
        with self._lock:  # no beat is in flight, and none will write again
            try:
                self._registry.deregister(self._record.worker_id)
            except RegistryError as exc:
                logger.warning("could not delete %s's key (it expires in %.1fs): %s",
                               self._record.worker_id, self._registry.ttl_s, exc)

    def _current_record(self) -> WorkerRecord:
        if self._load_fn is None:
            return self._record
        return self._record.with_load(self._load_fn())

    def _write(self, record: WorkerRecord) -> bool:
        with self._lock:
            if self._stopping.is_set():
                return False
            self._registry.register(record)
            return True

    def _run(self) -> None:
        while not self._stopping.wait(self._registry.heartbeat_s):
            self.beat()

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        message = f"{type(exc).__name__}: {exc}"
        if message != self.last_error:  # once per outage, not once per beat
            log = logger.error if isinstance(exc, FingerprintMismatch) else logger.warning
            log("heartbeat of %s failed (retrying every %.1fs): %s", self._record.worker_id,
                self._registry.heartbeat_s, message, exc_info=not isinstance(exc, RegistryError))
        self.last_error = message


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
