"""One leader per cluster: a Redis lock with a TTL (redis-py's ``Lock``), torch-free.

    election = Election(redis_url, cluster="default", name="planner", holder="planner-1a2b")
    if election.lead():   # every tick: True while this holder leads (acquired or renewed)
        ...
    election.resign()     # on a clean stop: the next candidate takes over at once

A leader leaves what the next one must know in the lock's note (``leave_note``, a string
kept a day; ``note`` reads it): the planner, when it last changed the cluster.

A leader that stops renewing (killed, hung, cut off from Redis) loses the lock when its
TTL lapses; a waiting candidate's next ``lead`` then wins it. A leader that finds the lock
taken by another (it lapsed meanwhile) learns it has lost at its next ``lead``. Redis
errors are not raised: a holder that cannot reach Redis does not lead (it cannot prove
it still holds the lock).
"""

from __future__ import annotations

import logging

import redis
from redis.backoff import NoBackoff
from redis.exceptions import LockError, RedisError
from redis.lock import Lock
from redis.retry import Retry

from cluster.registry import DEFAULT_CLUSTER, Keys, redact_url

log = logging.getLogger(__name__)
NOTE_TTL_S = 86_400  # a note outlives any leader's term that could still care about it


class Election:
    """``holder`` competing for the lock ``name`` of ``cluster``, held ``ttl_s`` per renewal."""

    def __init__(self, redis_url: str, *, cluster: str = DEFAULT_CLUSTER, name: str,
                 holder: str, ttl_s: float = 10.0, timeout_s: float = 2.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.holder = holder
        self.ttl_s = ttl_s
        self.key = Keys(cluster).lock(name)
        self._note_key = Keys(cluster).lock(name, "note")
        self._where = redact_url(redis_url)
        self._client = redis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), protocol=2, health_check_interval=0)
        self._lock = Lock(self._client, self.key, timeout=ttl_s, blocking=False,
                          thread_local=False)
        self.leading = False

    def lead(self) -> bool:
        """Acquire the lock, or renew it while held; whether this holder leads now."""
        try:
            if self.leading:
                self._lock.reacquire()  # the full TTL again; LockError: it was lost
            else:
                self.leading = bool(self._lock.acquire(token=self.holder))
                if self.leading:
                    log.info("%s leads (lock %s on %s, TTL %.1fs)", self.holder, self.key,
                             self._where, self.ttl_s)
        except LockError:
            log.warning("%s lost the lock %s (its TTL lapsed)", self.holder, self.key)
            self.leading = False
        except RedisError as exc:
            if self.leading:
                log.warning("%s cannot renew the lock on %s: %s", self.holder, self._where, exc)
            self.leading = False
        return self.leading

    def leader(self) -> str | None:
        """Who holds the lock now (None: nobody, or Redis did not answer)."""
        return self._read(self.key)

    def leave_note(self, note: str) -> bool:
        """While leading: leave ``note`` for the next leader (replacing the last); whether
        Redis took it (errors logged)."""
        if not self.leading:
            return False
        try:
            self._client.set(self._note_key, note, ex=NOTE_TTL_S)
        except RedisError as exc:
            log.warning("%s: the lock's note was not written: %s", self.holder, exc)
            return False
        return True

    def note(self) -> str | None:
        """The note a leader left (None: none, or Redis did not answer)."""
        return self._read(self._note_key)

    def _read(self, key: str) -> str | None:
        try:
            value = self._client.get(key)
        except RedisError:
            return None
        return value.decode() if isinstance(value, bytes) else value

    def resign(self) -> None:
        """Give the lock up now, if held (idempotent; errors logged)."""
        if not self.leading:
            return
        self.leading = False
        try:
            self._lock.release()
        except (LockError, RedisError) as exc:
            log.info("%s: the lock %s was not released: %s", self.holder, self.key, exc)

    def close(self) -> None:
        self.resign()
        self._client.close()
