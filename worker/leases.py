"""A worker's side of the router-owned leases (``cluster.leases``), torch-free.

``LeaseBook`` is what the worker holds attempts under: the servicers ``watch`` an
attempt's lease when it starts to hold something for it (Reserve, Prefill,
GenerateLocal) and ``forget`` it when the attempt ends on this worker (its call ended,
an Abort). ``LeaseWatcher`` (a daemon thread) checks the watched keys in Redis and frees
an attempt whose lease is gone — its router died or lost it — through ``abort``.

When it acts: a lease counts as missing only in a check that Redis answered. A lease this
watcher saw in the same Redis process (the same ``run_id``) with no outage or stall since
is freed in the first check that finds it missing: in one Redis that serves throughout, a
key expires only when its router stopped renewing it for a whole TTL (or deleted it), so
a dead router's holdings are freed within the TTL plus one check period (at most a
quarter TTL, 1 s) of its last renewal. Otherwise — never seen, or seen only before Redis
restarted, failed over, was unreachable, or answered a check slower than a check period —
the rule for Redis outages holds: any check Redis did not answer restarts every missing
clock, and an attempt is freed once its lease has been missing in every check for a full
TTL since Redis was last seen healthy. A Redis that answers reads but refuses writes (out
of memory, a read-only replica) is not healthy: its routers cannot renew their leases, so
each check also asks for a write (``SET … XX`` of a key that is not there, which writes
nothing) and a refusal counts as an outage.
A router re-writes its live leases every
``ttl / 3``, so a Redis that came back empty holds them again long before that. Redis must
not evict keys (``maxmemory-policy noeviction``, its default; the watcher warns at start
when it is not).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cluster.clock import SYSTEM_CLOCK, Clock
from cluster.leases import LeaseStore, LeaseStoreUnavailable

log = logging.getLogger(__name__)

MIN_PERIOD_S = 0.02
MAX_PERIOD_S = 1.0
IDLE_PERIOD_S = 0.25  # how often an idle watcher looks at its book


@dataclass(frozen=True)
class Watched:
    key: str
    ttl_s: float


class LeaseBook:
    """The leases of the attempts this worker holds something for (thread-safe).
    Disabled (``watch`` does nothing) until a ``LeaseWatcher`` is started on it: without
    Redis there is nothing to watch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[str, Watched] = {}
        self.enabled = False
        self.num_aborted = 0  # attempts freed because their lease was gone

    def watch(self, attempt_id: str, key: str, ttl_s: float) -> None:
        if self.enabled and key and ttl_s > 0:
            with self._lock:
                self._watched[attempt_id] = Watched(key, ttl_s)

    def forget(self, attempt_id: str) -> bool:
        """Stop watching ``attempt_id``'s lease; whether it was watched."""
        with self._lock:
            return self._watched.pop(attempt_id, None) is not None

    def retain(self, attempt_ids: set[str]) -> None:
        """Forget the leases of attempts not in ``attempt_ids`` (those the worker holds)."""
        with self._lock:
            for attempt_id in set(self._watched) - attempt_ids:
                del self._watched[attempt_id]

    def snapshot(self) -> dict[str, Watched]:
        with self._lock:
            return dict(self._watched)

    def __len__(self) -> int:
        with self._lock:
            return len(self._watched)


class LeaseWatcher:
    """Frees the attempts of ``book`` whose lease is gone (see module doc), calling
    ``abort(attempt_id)``; ``check()`` is one round (tests call it with a manual clock),
    ``start()`` runs rounds on a daemon thread every quarter of the shortest TTL."""

    def __init__(self, store: LeaseStore, book: LeaseBook, abort: Callable[[str], None],
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self._store = store
        self._book = book
        self._abort = abort
        self._clock = clock
        self._missing_since: dict[str, float] = {}  # attempt id -> first seen missing
        self._seen_in: dict[str, str] = {}  # attempt id -> run_id of the Redis it was seen in
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-lease-watcher",
                                        daemon=True)
        book.enabled = True

    def check(self) -> list[str]:
        """One round; returns the attempts it freed."""
        watched = self._book.snapshot()
        for gone in (self._missing_since, self._seen_in):
            for attempt_id in set(gone) - set(watched):
                del gone[attempt_id]
        if not watched:
            return []
        ids = list(watched)
        started = self._clock.monotonic()
        try:
            run_id, present = self._store.exist([watched[a].key for a in ids], writable=True)
        except LeaseStoreUnavailable as exc:
            if self._missing_since:
                log.warning("Redis unreachable or refusing writes (%s): %d missing leases get a "
                            "new TTL once it serves", exc, len(self._missing_since))
            self._missing_since.clear()  # Redis not seen healthy: start over
            self._seen_in.clear()  # and what was seen before may have expired meanwhile
            return []
        now = self._clock.monotonic()
        if now - started > self.period_s():  # Redis stalled: renewals may have waited
            self._seen_in.clear()
        freed = []
        for attempt_id, here in zip(ids, present, strict=True):
            if here:
                self._missing_since.pop(attempt_id, None)
                if run_id:
                    self._seen_in[attempt_id] = run_id
                continue
            if run_id and self._seen_in.get(attempt_id) == run_id:
                freed.append(attempt_id)  # expired (or deleted) in the Redis that held it
                continue
            since = self._missing_since.setdefault(attempt_id, now)
            if now - since >= watched[attempt_id].ttl_s:
                freed.append(attempt_id)
        for attempt_id in list(freed):
            self._missing_since.pop(attempt_id, None)
            self._seen_in.pop(attempt_id, None)
            if not self._book.forget(attempt_id):
                # forgotten since the snapshot: its call ended and its router closed the
                # lease (a stream ended with a move offer, say), not died: not ours to free
                freed.remove(attempt_id)
                continue
            log.warning("the lease %s of attempt %s is gone (its router died or lost it): "
                        "freeing it", watched[attempt_id].key, attempt_id)
            self._book.num_aborted += 1
            self._abort(attempt_id)
        return freed

    def period_s(self) -> float:
        ttls = [w.ttl_s for w in self._book.snapshot().values()]
        if not ttls:
            return IDLE_PERIOD_S
        return min(MAX_PERIOD_S, max(MIN_PERIOD_S, min(ttls) / 4))

    def start(self) -> LeaseWatcher:
        try:
            policy = self._store.eviction_policy()
        except LeaseStoreUnavailable:
            policy = ""  # not known yet; the checks will say when Redis answers
        if policy and policy != "noeviction":
            log.warning("Redis evicts keys (maxmemory-policy %s): an evicted lease frees its "
                        "attempt as if its router had died; run Redis with noeviction", policy)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self._store.close()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s()):
            try:
                self.check()
            except Exception:  # the watcher must survive anything; log and go on
                log.exception("checking leases failed")
