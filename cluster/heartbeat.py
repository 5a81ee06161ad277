"""A worker's heartbeat: keeps its record in Redis while it lives (torch-free).

``Heartbeat`` runs inside a worker (a daemon thread) and re-registers it every
``Registry.heartbeat_s``; it survives Redis outages (logs, retries on the next beat). The
router reads what heartbeats write through ``cluster.view.WorkerView``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from cluster.records import WorkerLoad, WorkerRecord
from cluster.registry import FingerprintMismatch, Registry, RegistryError

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
