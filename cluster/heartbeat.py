"""A worker's heartbeat: keeps its record in Redis while it lives (torch-free).

``Heartbeat`` runs inside a worker (a daemon thread) and re-registers it every
``Registry.heartbeat_s``; it survives Redis outages (logs, retries on the next beat), waits
to join when Redis is down at start, and gives up — telling its worker to exit — when the
cluster fingerprint keeps differing from its layout. The router reads what heartbeats
write through ``cluster.view.WorkerView``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType

from cluster.records import WorkerLoad, WorkerRecord
from cluster.registry import (
    ClusterTokenRequired,
    FingerprintMismatch,
    Registry,
    RegistryAuthError,
    RegistryError,
)

logger = logging.getLogger(__name__)

PROGRESS_S = 5.0
"""While a worker waits to join (Redis unreachable at start), a progress line this often."""


class Heartbeat:
    """Keeps one worker's record in Redis; owned by that worker (a daemon thread).

    ``start()`` registers once synchronously — raising ``FingerprintMismatch`` (the worker
    must exit, naming ``exc.field``) or ``RegistryAuthError`` (a configuration error). When
    Redis is unreachable it does not raise: the worker has not joined yet (``joined``
    False), and every beat tries again, with a progress line every ``PROGRESS_S`` naming
    what it waits for, until Redis answers. Then it re-registers every
    ``registry.heartbeat_s`` with fresh figures from ``load_fn``. Each beat re-claims the
    fingerprint and re-SETs the record with its TTL, so a restarted Redis is refilled
    within one beat. A failing beat (Redis down, ``load_fn`` raising) is logged once per
    outage and retried on the next beat; the thread never dies of it.

    A later beat that finds the cluster fingerprint differing from the record's layout
    retries for ``mismatch_grace_s`` (default: the TTL; the router re-asserts the
    fingerprint it pinned within one refresh, so a worker of the right layout sees such a
    mismatch only briefly after another worker claimed an emptied Redis). If it persists,
    the heartbeat stops, keeps the error in ``refused`` and calls ``on_mismatch(exc)`` (on
    its thread): the worker must then exit, naming ``exc.field``.
    ``stop()`` ends the thread and, by default, deletes the key (graceful shutdown).
    """

    def __init__(self, registry: Registry, record: WorkerRecord,
                 load_fn: Callable[[], WorkerLoad] | None = None, *,
                 on_mismatch: Callable[[FingerprintMismatch], None] | None = None,
                 mismatch_grace_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._record = record
        self._load_fn = load_fn
        self._on_mismatch = on_mismatch
        self._mismatch_grace_s = registry.ttl_s if mismatch_grace_s is None else mismatch_grace_s
        self._clock = clock
        self._lock = threading.Lock()  # held while writing; stop() takes it to delete
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats = 0
        self.failures = 0
        self.last_error: str | None = None
        self.joined = False  # registered at least once
        self.refused: FingerprintMismatch | None = None  # gave up: the worker must exit
        self._started_at = clock()
        self._progress_at = self._started_at  # when the last "waiting to join" line went out
        self._mismatch_since: float | None = None

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def registry(self) -> Registry:
        """The registry it beats into."""
        return self._registry

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Heartbeat:
        if self._thread is not None or self._stopping.is_set():
            raise RuntimeError("a Heartbeat starts once")
        self._started_at = self._progress_at = self._clock()
        try:
            self._write()
        except (RegistryAuthError, FingerprintMismatch, ClusterTokenRequired):
            raise  # refused: retrying would not change it
        except RegistryError as exc:  # unreachable, or full, read-only (a failover): wait
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.warning("%s has not joined the cluster yet: waiting for Redis (retrying "
                           "every %.1fs): %s", self._record.worker_id,
                           self._registry.heartbeat_s, exc)
        else:
            self._joined()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"pdserve-heartbeat-{self._record.worker_id}")
        self._thread.start()
        return self

    def beat(self) -> bool:
        """One beat now; True when the record was written. Never raises for Redis errors."""
        try:
            if not self._write():
                return False
        except Exception as exc:  # a beat must not kill the thread: log, retry next beat
            self._failed(exc)
            return False
        if self.last_error is not None:
            logger.info("heartbeat of %s: registered again after: %s",
                        self._record.worker_id, self.last_error)
            self.last_error = None
        self._joined()
        return True

    def set_role(self, role: str) -> bool:
        """The worker serves ``role`` now (a live switch): every later record says so, and
        one beat goes out at once so routers see it within their next refresh. True when
        that beat wrote the record."""
        with self._lock:
            self._record = replace(self._record, role=role)
        return self.beat()

    def set_draining(self) -> bool:
        """The worker is shutting down: every later record says so (routers stop routing
        to it, draining peers do not move work to it), one beat at once. True when that
        beat wrote the record."""
        with self._lock:
            self._record = replace(self._record, draining=True)
        return self.beat()

    def stop(self, *, deregister: bool = True, timeout_s: float = 10.0) -> None:
        """Stop beating; with ``deregister`` delete the key (else it expires after the TTL).

        Idempotent. A Redis outage during the delete is logged, not raised.
        """
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if not deregister:
            return
        with self._lock:  # no beat is in flight, and none will write again
            try:
                self._registry.deregister(self._record.worker_id)
            except RegistryError as exc:
                logger.warning("could not delete %s's key (it expires in %.1fs): %s",
                               self._record.worker_id, self._registry.ttl_s, exc)

    def _joined(self) -> None:
        self.beats += 1
        self._mismatch_since = None
        if not self.joined:
            self.joined = True
            waited = self._clock() - self._started_at
            if waited >= self._registry.heartbeat_s:
                logger.info("%s joined the cluster after waiting %.1fs for Redis",
                            self._record.worker_id, waited)

    def _current_record(self) -> WorkerRecord:
        if self._load_fn is None:
            return self._record
        return self._record.with_load(self._load_fn())

    def _write(self) -> bool:
        """Register the record as it is now, built under the lock: a beat that began before
        a ``set_role`` cannot write the role it replaced after that one's beat."""
        with self._lock:
            if self._stopping.is_set():
                return False
            self._registry.register(self._current_record())
            return True

    def _run(self) -> None:
        while not self._stopping.wait(self._registry.heartbeat_s):
            self.beat()

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, FingerprintMismatch):
            self._mismatched(exc)
        elif not self.joined and isinstance(exc, RegistryError) and \
                not isinstance(exc, RegistryAuthError):
            now = self._clock()
            if now - self._progress_at >= PROGRESS_S:
                self._progress_at = now
                logger.warning("%s still waiting to join the cluster, for %.0fs: %s",
                               self._record.worker_id, now - self._started_at, exc)
            self.last_error = message
            return
        if message != self.last_error:  # once per outage, not once per beat
            log = logger.error if isinstance(exc, FingerprintMismatch) else logger.warning
            log("heartbeat of %s failed (retrying every %.1fs): %s", self._record.worker_id,
                self._registry.heartbeat_s, message, exc_info=not isinstance(exc, RegistryError))
        self.last_error = message

    def _mismatched(self, exc: FingerprintMismatch) -> None:
        """A beat found the cluster fingerprint differing: give up once it has persisted
        for ``mismatch_grace_s``."""
        now = self._clock()
        if self._mismatch_since is None:
            self._mismatch_since = now
        if now - self._mismatch_since < self._mismatch_grace_s or self.refused is not None:
            return
        self.refused = exc
        self._stopping.set()
        logger.error("%s leaves the cluster: its layout has differed from the cluster "
                     "fingerprint for %.1fs: %s (differing field: %s)", self._record.worker_id,
                     now - self._mismatch_since, exc, exc.field)
        if self._on_mismatch is not None:
            self._on_mismatch(exc)
