"""Cluster state in Redis: the ``Registry`` client, its key schema and its errors.

Torch-free (imports ``redis``, ``cluster.records`` and ``engine.kvcache.layout`` only). The
records' JSON is ``cluster.records``; ``cluster.heartbeat`` keeps a worker's record alive
and ``cluster.view`` is the router's view of the live workers, both on a ``Registry``.

Key schema — built only by ``Keys``; everything lives under ``pdserve:{cluster}:``::

    worker:{worker_id}  WorkerRecord JSON. Written only by that worker's ``Heartbeat`` with
                        ``SET … PX ttl`` every beat (never EXPIRE: after a Redis restart
                        the key is simply written again); it vanishes ttl after the last
                        beat and is deleted by the worker on graceful stop.
    fingerprint         The cluster's ``KVLayout`` JSON, no TTL. ``SET NX`` by every
                        registration (so the first worker sets it and a restarted Redis gets
                        it back within one beat); re-asserted (overwritten) by the router on
                        every refresh once it pinned the layout of its own model
                        (``assert_fingerprint``), so a worker of another model that claims
                        it first after Redis lost its data does not keep it; nobody deletes it.
    resume_key          64 hex digits, no TTL: the routers' shared key of resume tokens in a
                        cluster without a cluster token (``router.resume``); ``SET NX`` by
                        the first router, read by every one, and ``SET NX`` again with the
                        key it seals with by each router's refresh (Redis lost its data).
    load:{router_id}    one router's load on each worker, short TTL (``cluster.router_loads``).
    kv_events           Redis stream, ``MAXLEN ~``: every worker's KV events, one entry per
                        batch (``cluster.kv_events``); every router reads all of it.
    scale_target        ``cluster.scale.ScaleTarget`` JSON, no TTL: the workers the leading
                        planner wants; written by it at each scale step, read by the launcher
                        that adds and removes workers (``pdserve up --ray``).
    token_required      "1", no TTL: set by every router and worker started with a cluster
                        token (``cluster.token``), and by such a router again in each new
                        Redis process (run_id); one started without refuses to join a
                        cluster that has it. Delete it to run a cluster without a token.

Redis down: ``Registry`` methods raise ``RegistryUnavailable`` after at most a few socket
timeouts (no retries inside); ``Heartbeat`` logs and retries on its next beat; ``WorkerView``
keeps its last-known-good view and reports it stale. Records are JSON with a version field,
decoded strictly; never pickle.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.clock import MAX_HEARTBEAT_S
from cluster.records import (
    ROLES,
    RecordFormatError,
    WorkerRecord,
    check_name,
    layout_from_json,
    layout_to_json,
)
from engine.kvcache.layout import KVLayout

logger = logging.getLogger(__name__)

DEFAULT_CLUSTER = "default"
DEFAULT_TTL_S = 10.0
DEFAULT_HEARTBEAT_S = 3.0
DEFAULT_TIMEOUT_S = 1.0  # socket connect and read timeout of every Redis call


class RegistryError(Exception):
    """Redis could not serve a registry operation (base class)."""


class RegistryUnavailable(RegistryError):
    """Redis is unreachable or did not answer within the timeout."""


class RegistryAuthError(RegistryError):
    """Redis refused the credentials of the URL (wrong or missing password)."""


class ClusterTokenRequired(RegistryError):
    """This process has no cluster token, and its cluster requires one."""

    def __init__(self, cluster: str) -> None:
        super().__init__(f"cluster {cluster!r} requires the cluster token: give "
                         "--cluster-token-file or $PDSERVE_CLUSTER_TOKEN (the same as its "
                         "other processes)")


class FingerprintMismatch(RegistryError):
    """A layout differs from the cluster's fingerprint; ``field`` names the first difference."""

    def __init__(self, cluster: str, diff: str) -> None:
        self.field = diff.split(":", 1)[0]
        super().__init__(f"KV layout differs from cluster {cluster!r}'s fingerprint in "
                         f"{self.field} (ours != cluster's: {diff.split(':', 1)[1].strip()})")


@dataclass(frozen=True)
class Keys:
    """The one place Redis key names are built."""

    cluster: str = DEFAULT_CLUSTER

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)

    @property
    def prefix(self) -> str:
        return f"pdserve:{self.cluster}:"

    @property
    def fingerprint(self) -> str:
        return f"{self.prefix}fingerprint"

    @property
    def token_required(self) -> str:
        return f"{self.prefix}token_required"

    @property
    def resume_key(self) -> str:
        return f"{self.prefix}resume_key"

    @property
    def worker_pattern(self) -> str:
        """SCAN pattern of all worker keys (names cannot hold glob characters)."""
        return f"{self.prefix}worker:*"

    @property
    def kv_events(self) -> str:
        return f"{self.prefix}kv_events"

    @property
    def scale_target(self) -> str:
        return f"{self.prefix}scale_target"

    def lock(self, name: str, beside: str = "") -> str:
        """A cluster-wide lock's key (``cluster.election``), or (``beside``) a key next to it."""
        check_name("lock", name)
        return f"{self.prefix}lock:{name}" + (f":{beside}" if beside else "")

    def worker(self, worker_id: str) -> str:
        check_name("worker_id", worker_id)
        return f"{self.prefix}worker:{worker_id}"

    def worker_id_of(self, key: str) -> str:
        return key.removeprefix(f"{self.prefix}worker:")


class Registry:
    """Client of the cluster state in one Redis. Thread-safe (one connection pool).

    Every call has ``timeout_s`` socket timeouts and no internal retries; Redis errors
    surface as ``RegistryUnavailable`` (unreachable, timed out), ``RegistryAuthError`` or
    ``RegistryError``. Messages name the Redis URL with its password redacted.
    """

    def __init__(self, redis_url: str, *, cluster: str = DEFAULT_CLUSTER,
                 ttl_s: float = DEFAULT_TTL_S, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not 0 < heartbeat_s < ttl_s or heartbeat_s > MAX_HEARTBEAT_S:
            raise ValueError(f"need 0 < heartbeat_s < ttl_s, heartbeat_s <= {MAX_HEARTBEAT_S} (the "
                             f"routers' grace for a missing worker), got {heartbeat_s}, {ttl_s}")
        if ttl_s < 0.001 or timeout_s <= 0:
            raise ValueError(f"ttl_s and timeout_s must be positive, got {ttl_s}, {timeout_s}")
        self.keys = Keys(cluster)
        self.ttl_s = ttl_s
        self.heartbeat_s = heartbeat_s
        self.where = redact_url(redis_url)
        self._client = redis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), protocol=2, health_check_interval=0)
        self._skip_reasons: dict[str, str] = {}  # key -> last reason logged (no log spam)

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def ping(self) -> None:
        """Raises unless Redis answers with these credentials (a startup check)."""
        with self._errors("pinging"):
            self._client.ping()

    def check_token(self, has_token: bool) -> None:
        """With a token: mark the cluster as requiring one. Without: ``ClusterTokenRequired``
        when it is so marked (see the key schema)."""
        with self._errors("checking the cluster token rule"):
            if has_token:
                self._client.set(self.keys.token_required, "1")
                return
            required = self._client.exists(self.keys.token_required)
        if required:
            raise ClusterTokenRequired(self.keys.cluster)

    def run_id(self) -> str:
        """The ``run_id`` of the Redis process answering ("" if unsaid): a new one lost
        what the last one held, unless it persisted or replicated it."""
        with self._errors("reading Redis's run id"):
            info = self._client.info("server")
        return str(info.get("run_id", ""))

    def resume_key(self, ours: bytes | None = None) -> bytes:
        """The routers' shared resume key (see the key schema), made by the first to ask;
        ``ours``: the key this router seals with, written if the key is missing (Redis lost
        its data: a router starting then takes the one the others use, not a new one)."""
        with self._errors("reading the resume key"):
            self._client.set(self.keys.resume_key,
                             ours.hex() if ours is not None else secrets.token_hex(32), nx=True)
            raw = self._client.get(self.keys.resume_key)
        try:
            key = bytes.fromhex(raw.decode() if isinstance(raw, bytes) else str(raw))
        except ValueError:
            key = b""
        if len(key) != 32:
            raise RegistryUnavailable(f"the resume key in Redis ({self.keys.resume_key}) is "
                                      "not 64 hex digits; delete it to have a new one made")
        return key

    def cluster_layout(self) -> KVLayout | None:
        """The cluster fingerprint, or ``None`` when none is set yet."""
        with self._errors("reading the cluster fingerprint"):
            raw = self._client.get(self.keys.fingerprint)
        return None if raw is None else self._decode_fingerprint(raw)

    def claim_fingerprint(self, layout: KVLayout) -> None:
        """Set the cluster fingerprint to ``layout`` unless one is set (``SET NX``);
        ``FingerprintMismatch`` naming the first differing field when the one set differs.
        Tensor-parallel sizes are not part of the layout."""
        with self._errors("claiming the cluster fingerprint"):
            for _ in range(3):  # the key may vanish (Redis restart) between SET NX and GET
                if self._client.set(self.keys.fingerprint, layout_to_json(layout), nx=True):
                    return
                raw = self._client.get(self.keys.fingerprint)
                if raw is not None:
                    break
            else:
                raise RegistryError(f"{self.keys.fingerprint} keeps vanishing at {self.where}")
        diff = layout.diff(self._decode_fingerprint(raw))
        if diff is not None:
            raise FingerprintMismatch(self.keys.cluster, diff)

    def assert_fingerprint(self, layout: KVLayout) -> str | None:
        """Make ``layout`` the cluster fingerprint, overwriting whatever is there (one
        atomic ``GETSET``; ``SET … GET`` needs Redis 6.2); only the router calls this, with
        the layout it pinned. ``None`` when the key already held ``layout``, else what was
        replaced: ``"missing"``, ``"malformed"`` or the first differing field (``"field:
        ours != theirs"``, as ``KVLayout.diff`` names it)."""
        with self._errors("re-asserting the cluster fingerprint"):
            raw = self._client.getset(self.keys.fingerprint, layout_to_json(layout))
        if raw is None:
            return "missing"
        try:
            return layout.diff(layout_from_json(raw))  # type: ignore[arg-type]
        except RecordFormatError:
            return "malformed"

    def register(self, record: WorkerRecord) -> None:
        """Claim the fingerprint, then ``SET worker-key record PX ttl`` (refreshes the TTL).

        Called by the worker (through ``Heartbeat``) only once its endpoints are ready.
        Raises ``FingerprintMismatch`` without writing when the layouts differ.
        """
        self.claim_fingerprint(record.layout)
        with self._errors(f"registering worker {record.worker_id}"):
            self._client.set(self.keys.worker(record.worker_id), record.to_json(),
                             px=max(1, round(self.ttl_s * 1000)))

    def deregister(self, worker_id: str) -> None:
        """Delete the worker's key (idempotent). Only the worker itself should call this."""
        with self._errors(f"deregistering worker {worker_id}"):
            self._client.delete(self.keys.worker(worker_id))

    def list_workers(self, role: str | None = None) -> list[WorkerRecord]:
        """Live workers (of ``role``) sorted by id, via SCAN + MGET. Skips, logging once
        per key and reason: malformed records, records whose key and id disagree, and
        records whose layout differs from the cluster fingerprint (all of them while no
        fingerprint is set: they cannot be checked; heartbeats restore it)."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES} or None, got {role!r}")
        with self._errors("listing workers"):
            raw_fingerprint = self._client.get(self.keys.fingerprint)
            keys = [k.decode() for k in self._client.scan_iter(match=self.keys.worker_pattern, count=512)]
            values = self._client.mget(keys) if keys else []
        try:
            cluster = None if raw_fingerprint is None else layout_from_json(raw_fingerprint)
        except RecordFormatError as exc:
            logger.error("ignoring every worker: malformed %s: %s", self.keys.fingerprint, exc)
            cluster = None
        records = []
        for key, raw in zip(keys, values, strict=True):
            if raw is not None:  # None: expired between SCAN and MGET
                record = self._accept(key, raw, cluster)
                if record is not None and role in (None, record.role):
                    records.append(record)
        return sorted(records, key=lambda r: r.worker_id)

    def set_scale_target(self, text: str) -> None:
        """Write the planner's scale target (``cluster.scale``), replacing the last."""
        with self._errors("writing the scale target"):
            self._client.set(self.keys.scale_target, text)

    def scale_target(self) -> bytes | None:
        """The latest scale target's JSON (None: the planner never wrote one)."""
        with self._errors("reading the scale target"):
            raw: bytes | str | None = self._client.get(self.keys.scale_target)
        return raw.encode() if isinstance(raw, str) else raw

    def publish_kv_events(self, fields: Mapping[str, bytes], maxlen: int) -> None:
        """Append one KV event entry (``cluster.kv_events``) to the cluster's stream,
        trimmed to about ``maxlen`` entries."""
        with self._errors("publishing KV events"):
            self._client.xadd(self.keys.kv_events, dict(fields),  # type: ignore[arg-type]
                              maxlen=maxlen, approximate=True)

    def kv_events_tail(self) -> str:
        """The id of the KV event stream's newest entry (``0-0`` when it is empty)."""
        with self._errors("reading the KV event stream"):
            last: Any = self._client.xrevrange(self.keys.kv_events, count=1)
        return last[0][0].decode() if last else "0-0"

    def read_kv_events(self, after: str, *, block_ms: int, count: int
                       ) -> list[tuple[str, dict[bytes, bytes]]]:
        """KV event entries after id ``after``, oldest first: at most ``count``, waiting
        up to ``block_ms`` (less than the socket timeout) for the first."""
        with self._errors("reading the KV event stream"):
            reply: Any = self._client.xread({self.keys.kv_events: after}, count=count,
                                            block=block_ms)
        return [(entry_id.decode(), fields)
                for _, entries in reply or () for entry_id, fields in entries]

    def _accept(self, key: str, raw: bytes | str, cluster: KVLayout | None
                ) -> WorkerRecord | None:
        try:
            record = WorkerRecord.from_json(raw)
        except RecordFormatError as exc:
            self._skip(key, f"malformed record: {exc}")
            return None
        reason = None
        if record.worker_id != self.keys.worker_id_of(key):
            reason = f"record names worker {record.worker_id!r}"
        elif cluster is None:
            reason = "no valid cluster fingerprint to check its layout against"
        elif (diff := record.layout.diff(cluster)) is not None:
            reason = f"KV layout differs from the cluster fingerprint: {diff}"
        if reason is not None:
            self._skip(key, reason)
            return None
        self._skip_reasons.pop(key, None)
        return record

    def _skip(self, key: str, reason: str) -> None:
        if self._skip_reasons.get(key) != reason:
            if len(self._skip_reasons) > 10_000:
                self._skip_reasons.clear()
            self._skip_reasons[key] = reason
            logger.warning("ignoring %s: %s", key, reason)

    def _decode_fingerprint(self, raw: bytes | str) -> KVLayout:
        try:
            return layout_from_json(raw)
        except RecordFormatError as exc:
            raise RegistryError(f"malformed {self.keys.fingerprint} at {self.where}: {exc}") \
                from None

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except redis.AuthenticationError as exc:
            raise RegistryAuthError(f"Redis at {self.where} refused authentication while "
                                    f"{action}: {exc} (check the password in the Redis URL)"
                                    ) from None
        except redis.ResponseError as exc:
            if str(exc).startswith(("NOAUTH", "WRONGPASS")):
                raise RegistryAuthError(f"Redis at {self.where} refused authentication while "
                                        f"{action}: {exc}") from None
            raise RegistryError(f"Redis at {self.where} failed while {action}: {exc}") from exc
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RegistryUnavailable(f"Redis at {self.where} is unreachable while {action}: "
                                      f"{exc}") from exc
        except redis.RedisError as exc:
            raise RegistryError(f"Redis at {self.where} failed while {action}: {exc}") from exc


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    return re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1***@", url)


