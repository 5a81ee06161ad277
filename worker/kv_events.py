"""A worker's KV event publisher: what its prefix cache gains and loses, to every router.

The engine's block pool appends to a ``KVEventLog`` (``engine.kvcache.events``); this
publisher's thread drains it every ``period_s``, numbers each batch (``seq``, from 1 in
this process's ``epoch``) and appends it to the cluster's Redis stream
(``cluster.kv_events``). It keeps a mirror of the keys the cache holds as of its last
batch, so ``snapshot()`` is exactly what a router that applied batches 1..seq knows: the
worker serves it (``KVSnapshot`` RPC) to a router that must resynchronise.

Redis down: a batch that cannot be published is dropped (its sequence number is used),
so every router sees a gap at the next batch that gets through and resynchronises. While
the last batch did not get through, an empty one is sent every period, so that gap shows
as soon as Redis answers again, even from a worker whose cache then stays unchanged. A
batch Redis took and then lost (a restart, a failover, a router behind by more than the
stream keeps) shows too: with nothing to say for ``KEEPALIVE_S``, an empty batch goes, so
a quiet worker's routers see the gap within that. The publisher never blocks the engine:
it only drains a deque.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from cluster import pause_points
from cluster.kv_events import MAX_OPS_PER_BATCH, STREAM_MAXLEN, EventBatch, encode
from cluster.registry import Registry, RegistryError
from engine.kvcache.events import STORED, KVEventLog

log = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 0.02
KEEPALIVE_S = 5.0  # an empty batch after this long without one (see the module doc)


@dataclass(frozen=True)
class KVSnapshot:
    """The keys a worker's cache held at batch ``seq`` of ``epoch``."""

    epoch: int
    seq: int
    block_hashes: tuple[bytes, ...]


class KVEventPublisher:
    """Publishes ``events`` as ``worker_id``'s batches through ``registry``."""

    def __init__(self, registry: Registry, worker_id: str, events: KVEventLog, *,
                 period_s: float = DEFAULT_PERIOD_S) -> None:
        self._registry = registry
        self.worker_id = worker_id
        self._events = events
        self._period_s = period_s
        self.epoch = time.time_ns()  # the cache starts empty with this process
        self._seq = 0
        self._mirror: set[bytes] = set()
        self._lock = threading.Lock()  # seq and mirror, against snapshot()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events",
                                        daemon=True)
        self.published = 0  # batches Redis took
        self.dropped = 0  # batches it did not (routers resynchronise)
        self._failing = False
        self._sent_at = time.monotonic()  # its last batch

    def start(self) -> KVEventPublisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Publish what is left (once), stop the thread, close the registry."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._registry.close()

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            return KVSnapshot(self.epoch, self._seq, tuple(self._mirror))

    def publish_once(self) -> int:
        """Publish what the log holds now (in batches of at most ``MAX_OPS_PER_BATCH``);
        with nothing to publish, an empty batch the first time (batch 1 announces the
        epoch: routers forget what an earlier process of this worker id held) and while
        the last batch did not get through (its gap must reach the routers); returns how
        many batches were made. While Redis does not take them, the whole log goes into
        the snapshot at once and one empty batch is tried (the routers resynchronise from
        the snapshot after the gap anyway): the log never outgrows a slow or absent Redis,
        nor does a backlog follow its return."""
        made = 0
        while True:
            failing = self._failing
            ops = self._events.drain(None if failing else MAX_OPS_PER_BATCH)
            quiet = time.monotonic() - self._sent_at >= KEEPALIVE_S
            if not ops and (made or (self._seq and not failing and not quiet)):
                return made
            if ops and pause_points.enabled():
                pause_points.pause("kv_events.publish", ops=len(ops))
            with self._lock:
                self._seq += 1
                for op, block_hash in ops:
                    if op == STORED:
                        self._mirror.add(block_hash)
                    else:
                        self._mirror.discard(block_hash)
                batch = EventBatch(self.worker_id, self.epoch, self._seq,
                                   () if failing else tuple(ops), time.time())
            self._send(batch)
            self._sent_at = time.monotonic()
            made += 1
            if failing:
                return made

    def _send(self, batch: EventBatch) -> None:
        try:
            self._registry.publish_kv_events(encode(batch), STREAM_MAXLEN)
        except RegistryError as exc:
            self.dropped += 1
            if not self._failing:
                log.warning("KV events not published (routers will resynchronise): %s", exc)
            self._failing = True
            return
        if self._failing:
            log.info("KV events published again")
        self._failing = False
        self.published += 1

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.publish_once()
            except Exception:  # noqa: BLE001 - a publisher bug must not kill the worker
                log.exception("publishing KV events failed")
        try:
            self.publish_once()
        except Exception:  # noqa: BLE001 - stopping (the registry may be closed meanwhile)
            log.exception("publishing the last KV events failed")
