"""Feeds the router's ``KVIndex`` from the cluster's KV event stream and the workers'
snapshots; the I/O around the I/O-free index.

``KVFeed.run`` (one asyncio task) reads the Redis stream (``cluster.kv_events``) from the
newest entry there when it started, on a thread of its own (a blocking ``XREAD`` of
``READ_BLOCK_MS``), applies each batch on the event loop and asks the workers that want
one for a snapshot (``KVSnapshot`` RPC, in the background). ``watch`` gives it the live
workers after every refresh of the worker view. Redis down: it logs once, retries every
``RETRY_S``, and the index ages until routing stops trusting it.

Metrics (``RouterMetrics``): ``pdserve:router_kv_events_total{outcome}``,
``pdserve:router_kv_resyncs_total``, ``pdserve:router_kv_index_blocks``,
``pdserve:router_kv_event_lag_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc

from cluster.kv_events import BadEvent, decode
from cluster.records import WorkerRecord
from cluster.registry import Registry, RegistryError
from router.kv_index import APPLIED, BAD_OUTCOMES, DUPLICATE, KVIndex
from router.metrics import RouterMetrics
from router.worker_calls import KVSnapshot, kv_snapshot
from router.workers import WorkerPool

logger = logging.getLogger(__name__)

READ_BLOCK_MS = 250
READ_COUNT = 512
RETRY_S = 0.5
SNAPSHOT_TIMEOUT_S = 5.0


class KVFeed:
    """The KV index's I/O (see the module docstring)."""

    def __init__(self, index: KVIndex, registry: Registry, pool: WorkerPool,
                 metrics: RouterMetrics) -> None:
        self.index = index
        self._registry = registry
        self._pool = pool
        self._metrics = metrics
        self._records: dict[str, WorkerRecord] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-kv-feed")
        self._snapshots: set[asyncio.Task[None]] = set()
        self._failing = False
        self._shown: set[str] = set()  # workers with a kv_index_worker_blocks sample
        # snapshots are asked for once the stream's position is read: one taken before
        # would miss the batches published between it and that position
        self._positioned = False

    def watch(self, records: list[WorkerRecord]) -> None:
        """The live workers (every role); the index forgets the others, and what it knew
        of a worker whose registration names a new process."""
        for record in records:
            known = self._records.get(record.worker_id)
            if known is not None and (known.grpc_address, known.started_at) != \
                    (record.grpc_address, record.started_at):
                self.index.restarted(record.worker_id)
        self._records = {r.worker_id: r for r in records}
        self.index.watch(self._records)
        if self._positioned:
            self._ask_snapshots()

    async def run(self) -> None:
        """Read and apply events until cancelled."""
        loop = asyncio.get_running_loop()
        after: str | None = None
        while True:
            try:
                if after is None:
                    after = await loop.run_in_executor(self._thread,
                                                       self._registry.kv_events_tail)
                    self.index.heard()  # reading from here on: the snapshots are current
                    self._positioned = True
                    self._ask_snapshots()
                entries = await loop.run_in_executor(self._thread, partial(
                    self._registry.read_kv_events, after, block_ms=READ_BLOCK_MS,
                    count=READ_COUNT))
            except RegistryError as exc:
                if not self._failing:
                    logger.warning("KV events unreadable (the index ages): %s", exc)
                self._failing = True
                self._metrics.kv_index_trusted.set(self.index.trusted())
                await asyncio.sleep(RETRY_S)
                continue
            except Exception:  # noqa: BLE001 - the feed must outlive any bug: log, go on
                logger.exception("reading KV events failed")
                await asyncio.sleep(RETRY_S)
                continue
            if self._failing:
                logger.info("KV events readable again")
            self._failing = False
            if len(entries) < READ_COUNT:  # caught up: the index is as current as the stream
                self.index.heard()  # (a full page is a backlog: trust ages while it is read)
            for entry_id, fields in entries:
                after = entry_id
                try:
                    self._apply(fields)
                except Exception:  # noqa: BLE001 - one bad entry must not stop the feed
                    logger.exception("applying a KV event failed")
            self._figures()
            self._ask_snapshots()

    def _apply(self, fields: dict[bytes, bytes]) -> None:
        try:
            batch = decode(fields)
        except BadEvent as exc:
            self._bad(exc.reason, str(exc))
            return
        outcome = self.index.apply(batch)
        if outcome in BAD_OUTCOMES:
            self._bad(outcome, f"KV event batch {batch.seq} of {batch.worker_id} "
                               f"(epoch {batch.epoch}): {outcome}")
            return
        self._metrics.kv_events.labels(outcome).inc()
        if batch.sent_at:
            self._metrics.kv_event_lag.observe(max(0.0, time.time() - batch.sent_at))

    def _figures(self) -> None:
        metrics, index = self._metrics, self.index
        metrics.kv_index_blocks.set(index.num_blocks)
        metrics.kv_index_trusted.set(index.trusted())
        for worker_id in index.workers():
            metrics.kv_worker_blocks.labels(worker_id).set(index.num_blocks_of(worker_id))
        for worker_id in self._shown - set(index.workers()):
            metrics.kv_worker_blocks.remove(worker_id)
        self._shown = set(index.workers())

    def _bad(self, reason: str, message: str) -> None:
        self._metrics.kv_events.labels(reason).inc()
        logger.debug("ignored a KV event: %s", message)

    def _ask_snapshots(self) -> None:
        for worker_id in self.index.wanted():
            task = asyncio.get_running_loop().create_task(self._snapshot(worker_id))
            self._snapshots.add(task)
            task.add_done_callback(self._snapshots.discard)

    async def _snapshot(self, worker_id: str) -> None:
        record = self._records.get(worker_id)
        outcome = None
        try:
            if record is None:
                raise KeyError(worker_id)
            try:
                reply = await kv_snapshot(self._pool.channel(worker_id), record.role,
                                          SNAPSHOT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                reply = KVSnapshot(0, 0, [])  # an older worker: it publishes nothing
            # a worker that publishes nothing holds nothing the index could know of
            outcome = self.index.load_snapshot(worker_id, reply.epoch, reply.seq,
                                               reply.block_hashes)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: ask again later
            logger.info("no KV snapshot from %s yet: %s", worker_id,
                        exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc)
        if outcome == APPLIED:
            self._metrics.kv_resyncs.inc()
            self._figures()
            logger.info("KV index of %s resynchronised: %d blocks at batch %d", worker_id,
                        len(reply.block_hashes), reply.seq)
        elif outcome != DUPLICATE:  # failed, or older than what the index knows: later
            await asyncio.sleep(RETRY_S)
            self.index.snapshot_failed(worker_id)

    async def stop(self) -> None:
        for task in list(self._snapshots):
            task.cancel()
        await asyncio.gather(*self._snapshots, return_exceptions=True)
        # a blocked read returns within READ_BLOCK_MS: wait for it before closing Redis
        await asyncio.to_thread(self._thread.shutdown, wait=True)
        self._registry.close()
