"""A router-owned lease per attempt, in the cluster's Redis (torch-free).

Every attempt of a request (``router.lifecycle.attempt``) has a lease: one Redis key the
router that owns the attempt writes before it asks a worker to hold anything, renews while
the attempt lives, and deletes when it ends. Workers that hold something for the attempt
(a reservation, a queued or pinned prefill, a running stream) watch the key
(``worker.leases``) and free what they hold once it is gone — the router died, or lost
the attempt — independently of transfer timeouts.

Key schema (beside ``cluster.registry``'s, under the same ``pdserve:{cluster}:`` prefix)::

    lease:{attempt_id}  JSON ``{"attempt_id", "client_request_id", "holders"}``
                        (``holders``: the worker ids asked to hold something for the
                        attempt, in order), written with ``SET … PX ttl`` on every
                        renewal (never EXPIRE: after a Redis restart the key is written
                        again within one renewal period).

An attempt id is minted by its router (``router.lifecycle.attempt.AttemptIds``):
``{router_id}-{n}``, unique across routers (``router_id`` is random per router process),
never a client's request id. The lease is something an attempt has; its id does not come
from here.

Redis outages must not kill healthy work: the router keeps every live lease in memory
and re-writes all of them every ``ttl / 3`` (``LeaseKeeper``), so a Redis that came back
empty holds them again within one renewal period; a worker acts on a missing lease only
while Redis answers and takes writes, and only after it has been missing for a full TTL
since Redis was last seen healthy (``worker.leases.LeaseWatcher``) — unless the worker saw
the key in the same Redis process (same ``run_id``, no outage or stall since): then it
expired or was deleted because its router stopped renewing it, and the worker frees at
once. Redis must not evict keys (``maxmemory-policy noeviction``, its default).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.clock import SYSTEM_CLOCK, Clock
from cluster.records import check_name

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 10.0
TIMEOUT_S = 1.0  # socket connect and read timeout of every lease call


class LeaseStoreUnavailable(Exception):
    """Redis did not answer a lease call (unreachable, timed out, or refused it)."""


def new_router_id() -> str:
    """A random router id (names its attempts and leases; unique per router process)."""
    return secrets.token_hex(6)


@dataclass(frozen=True)
class LeaseKeys:
    """The one place lease key names are built."""

    cluster: str

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)

    @property
    def pattern(self) -> str:
        """SCAN pattern of every lease key of the cluster."""
        return f"pdserve:{self.cluster}:lease:*"

    def router_pattern(self, router_id: str) -> str:
        """SCAN pattern of the lease keys of ``router_id``'s attempts."""
        return f"pdserve:{self.cluster}:lease:{router_id}-*"

    def lease(self, attempt_id: str) -> str:
        return f"pdserve:{self.cluster}:lease:{attempt_id}"

    def probe(self, name: str) -> str:
        """A key never written (``SET … XX`` of a key that is not there), asked to learn
        whether Redis takes writes."""
        return f"pdserve:{self.cluster}:lease_probe:{name}"


class LeaseStore:
    """Lease keys in one Redis: write (SET PX), delete, exist, list. Thread-safe; every
    call has short socket timeouts and no retries, and raises ``LeaseStoreUnavailable``
    when Redis does not serve it."""

    def __init__(self, redis_url: str, *, cluster: str = "default",
                 timeout_s: float = TIMEOUT_S) -> None:
        self.keys = LeaseKeys(cluster)
        self._probe = self.keys.probe(secrets.token_hex(8))
        self._client = redis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), protocol=2, health_check_interval=0)

    def close(self) -> None:
        self._client.close()

    def write(self, values: dict[str, str], ttl_ms: int) -> None:
        """``SET key value PX ttl_ms`` for each item, in one round trip."""
        if values:
            with _errors("writing leases"):
                pipe = self._client.pipeline(transaction=False)
                for key, value in values.items():
                    pipe.set(key, value, px=ttl_ms)
                pipe.execute()

    def delete(self, keys: Sequence[str]) -> None:
        if keys:
            with _errors("deleting leases"):
                self._client.delete(*keys)

    def exist(self, keys: Sequence[str], *, writable: bool = False) -> tuple[str, list[bool]]:
        """Whether each key is in Redis now, and the ``run_id`` of the Redis process that
        answered ("" if it does not say), in one round trip. A different ``run_id`` is a
        different Redis (restarted, or failed over): keys seen in another may be lost.
        ``writable``: also ``LeaseStoreUnavailable`` when Redis refuses a write such as a
        lease's renewal (out of memory, a read-only replica): a lease missing then may
        be one its router could not renew."""
        with _errors("reading leases"):
            pipe = self._client.pipeline(transaction=False)
            pipe.info("server")
            if writable:
                pipe.set(self._probe, "", px=1, xx=True)  # refused as a SET is; writes nothing
            for key in keys:
                pipe.exists(key)
            info, *present = pipe.execute(raise_on_error=False)
        if writable and isinstance(present[0], Exception):
            raise LeaseStoreUnavailable(f"Redis refuses writes: {present.pop(0)}")
        del present[:int(writable)]
        for answer in present:
            if isinstance(answer, Exception):
                raise LeaseStoreUnavailable(f"Redis failed while reading leases: {answer}")
        run_id = str(info.get("run_id", "")) if isinstance(info, dict) else ""
        return run_id, [bool(n) for n in present]

    def eviction_policy(self) -> str:
        """Redis's ``maxmemory-policy`` ("" if it does not say): leases need
        ``noeviction`` (the default), since an evicted lease reads as a dead router."""
        with _errors("reading Redis's memory policy"):
            info = self._client.info("memory")
        return str(info.get("maxmemory_policy", ""))

    def list(self, router_id: str | None = None) -> list[str]:
        """Every lease key of the cluster (of ``router_id`` only, if given), sorted."""
        pattern = self.keys.pattern if router_id is None else self.keys.router_pattern(router_id)
        with _errors("listing leases"):
            return sorted(k.decode() for k in self._client.scan_iter(match=pattern, count=512))


class _errors:
    def __init__(self, action: str) -> None:
        self._action = action

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, redis.RedisError):
            raise LeaseStoreUnavailable(f"Redis failed while {self._action}: {exc}") from None


@dataclass
class Lease:
    """One live attempt's lease, as its router keeps it (``key``: "" without a store)."""

    attempt_id: str
    client_request_id: str
    key: str
    holders: list[str] = field(default_factory=list)

    def value(self) -> str:
        return json.dumps({"attempt_id": self.attempt_id,
                           "client_request_id": self.client_request_id, "holders": self.holders})


class LeaseKeeper:
    """A router's leases (one asyncio event loop): ``open`` one per attempt, ``hold`` as
    it asks workers to hold something, ``close`` when the attempt ends.

    One writer task does every Redis call, in order, off the event loop on a thread of its
    own (so no burst of other work queued on the default executor delays a renewal, and a
    write still in flight when ``stop`` deletes is done before the delete): new
    and changed leases are written and ended ones deleted at once (batched), and every
    ``ttl / 3`` all live leases are written again (renewal, and the re-write after Redis
    lost them). A failed write or delete is kept and tried again on the next round; Redis
    being down never fails an attempt. ``start`` / ``stop`` (which deletes every lease left,
    bounded). Without a store (``None``: a router with no Redis, unit tests) an attempt's
    lease has an empty key: workers watch nothing.
    """

    def __init__(self, store: LeaseStore | None, ttl_s: float = DEFAULT_LEASE_TTL_S,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        if ttl_s < 0.03:
            raise ValueError(f"the lease TTL must be >= 0.03s, got {ttl_s}")
        self.store = store
        self.ttl_s = ttl_s
        self._clock = clock
        self._live: dict[str, Lease] = {}
        self._dirty: set[str] = set()  # attempt ids to write now
        self._ended: set[str] = set()  # keys to delete
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-leases")
        self.num_failures = 0  # rounds that Redis did not serve

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def renew_s(self) -> float:
        return self.ttl_s / 3

    def open(self, attempt_id: str, client_request_id: str) -> Lease:
        """The lease of a new attempt (written at once); ``ValueError`` for an id that has
        a live lease already."""
        if attempt_id in self._live:
            raise ValueError(f"attempt {attempt_id!r} has a live lease already")
        key = "" if self.store is None else self.store.keys.lease(attempt_id)
        lease = Lease(attempt_id, client_request_id, key)
        self._live[lease.attempt_id] = lease
        self._mark(lease.attempt_id)
        return lease

    def hold(self, lease: Lease, worker_id: str) -> None:
        """``worker_id`` is asked to hold something for the attempt (named in the value)."""
        if worker_id not in lease.holders and lease.attempt_id in self._live:
            lease.holders.append(worker_id)
            self._mark(lease.attempt_id)

    def close(self, lease: Lease) -> None:
        """The attempt ended: its lease is deleted (soon; idempotent)."""
        if self._live.pop(lease.attempt_id, None) is not None and self.store is not None:
            self._dirty.discard(lease.attempt_id)
            self._ended.add(lease.key)
            self._wake.set()

    def live(self) -> list[Lease]:
        return list(self._live.values())

    @property
    def num_unwritten(self) -> int:
        """Writes and deletes not done yet (queued, or failing while Redis is down)."""
        return len(self._dirty) + len(self._ended)

    def _mark(self, attempt_id: str) -> None:
        if self.store is not None:
            self._dirty.add(attempt_id)
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Stops renewing and deletes every lease it still has (bounded)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._ended |= {lease.key for lease in self._live.values()}
        self._live.clear()
        self._dirty.clear()
        try:
            await asyncio.wait_for(self._flush(renew=False), timeout_s)
        except TimeoutError:
            logger.warning("could not delete %d leases before stopping", len(self._ended))
        self._thread.shutdown(wait=False)

    async def _run(self) -> None:
        next_renewal = self._clock.monotonic()
        while True:
            renew = self._clock.monotonic() >= next_renewal
            if renew:
                next_renewal = self._clock.monotonic() + self.renew_s
            await self._flush(renew)
            timeout = max(0.0, next_renewal - self._clock.monotonic())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    async def _flush(self, renew: bool) -> None:
        """One round: write the dirty leases (all live ones on ``renew``), delete the
        ended ones. What fails stays to do."""
        self._wake.clear()
        ids = list(self._live) if renew else [a for a in self._dirty if a in self._live]
        values = {self._live[a].key: self._live[a].value() for a in ids}
        ended = list(self._ended)
        self._dirty.difference_update(ids)
        self._ended.difference_update(ended)
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._thread, self._write_and_delete, values, ended)
        except LeaseStoreUnavailable as exc:
            self.num_failures += 1
            if self.num_failures == 1 or self.num_failures % 100 == 0:
                logger.warning("leases not written (%d rounds failed so far): %s",
                               self.num_failures, exc)
            self._dirty.update(a for a in ids if a in self._live)
            self._ended.update(ended)

    def _write_and_delete(self, values: dict[str, str], ended: Iterable[str]) -> None:
        if self.store is None:
            return
        self.store.write(values, self.ttl_ms)
        self.store.delete(list(ended))
