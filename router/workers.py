"""The router's workers: who is there, how to reach them, how busy the router keeps them.

``WorkerPool`` owns a last-known-good ``WorkerView`` of the Redis registry, one gRPC
channel per routable worker, the router's own in-flight count per worker and a short
"suspect" list of workers whose calls just failed. A worker is routable when its record
is in the view (or left it less than ``keep_missing_s`` ago, so a Redis restart that
empties the registry for one heartbeat does not stop traffic; time while Redis is
unreachable does not count), its model fingerprint is
the router's, its ``grpc.health.v1`` check answered SERVING at the last refresh (a
zombie whose engine loop died answers NOT_SERVING; a hung one does not answer), and it
is not suspect. A worker whose checks time out ``HUNG_AFTER`` times in a row, and whose
calls did not answer anything meanwhile (``heard_from``), is hung: the calls waiting on
it are cancelled (so they are retried elsewhere). A worker whose streams still deliver is
busy, never hung, however late its health answers arrive (a saturated router sees every
answer late). A worker gone from the registry for longer than ``keep_missing_s`` is no
longer routable; its channel is closed once the router has no call in flight on it (a
registration that lapses for a few seconds, e.g. a delayed heartbeat, must not cancel the
worker's healthy streams), and reused if the worker comes back first. Used from one
asyncio loop; ``refresh`` runs the Redis read in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.auth import token_call_interceptors
from cluster.internal_tls import InternalTLS
from cluster.keepalive import CHANNEL_OPTIONS as KEEPALIVE_CHANNEL_OPTIONS
from cluster.keepalive import INTERNAL_MAX_MESSAGE_BYTES
from cluster.records import WorkerRecord
from cluster.registry import Registry
from cluster.token import ClusterToken
from cluster.view import WorkerView
from engine.kvcache.layout import PROTOCOL_VERSION, KVLayout
from router.load_book import LoadBook

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", INTERNAL_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", INTERNAL_MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
    *KEEPALIVE_CHANNEL_OPTIONS,
)
HUNG_AFTER = 2  # consecutive health checks that time out before a worker's calls are taken back
HEALTH_TIMEOUT_S = 2.0  # a health check not answered within this long counts as timed out


@dataclass
class _Known:
    record: WorkerRecord
    channel: grpc.aio.Channel
    last_seen: float
    serving: bool = False
    timeouts: int = 0  # consecutive health checks without an answer in time
    gone: bool = False  # missing longer than keep_missing_s; kept for its calls in flight


class WorkerPool(LoadBook):
    """Routable workers of one model, their channels and (``LoadBook``) the router's load
    on them."""

    def __init__(self, registry: Registry, model_fingerprint: str, *,
                 keep_missing_s: float = 6.0, suspect_s: float = 5.0,
                 health_timeout_s: float = HEALTH_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 token: ClusterToken | None = None, tls: InternalTLS | None = None) -> None:
        self._view = WorkerView(registry, clock=clock, model_fingerprint=model_fingerprint)
        self._fingerprint = model_fingerprint
        self._keep_missing_s = keep_missing_s
        self._suspect_s = suspect_s
        self._health_timeout_s = health_timeout_s
        self._clock = clock
        self._interceptors = token_call_interceptors(token)  # the cluster token on each call
        self._credentials = None if tls is None else tls.channel_credentials()
        self._known: dict[str, _Known] = {}
        self._suspect_until: dict[str, float] = {}
        super().__init__()
        self._calls: dict[str, set[grpc.aio.Call]] = {}  # see ``watched``
        self._heard_from: dict[str, float] = {}  # worker id -> clock() of its last answer
        self._foreign: set[str] = set()  # ids logged as serving another model
        self._closing: set[asyncio.Task[None]] = set()  # channels being closed
        # Redis reads on a thread of their own: no burst of tokenizations delays them
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pdserve-view")

    # ----------------------------------------------------------------- the view

    async def refresh(self) -> None:
        """Read Redis (in a thread) and update the routable set; never raises for Redis."""
        snapshot = await asyncio.get_running_loop().run_in_executor(self._thread,
                                                                    self._view.refresh)
        now = self._clock()
        if snapshot.stale:
            # Redis cannot say who left, so nobody is missing while it is unreachable: the
            # keep_missing_s window starts again when it answers. Else a Redis that comes
            # back empty after an outage longer than that window (restarted) would drop
            # every worker at once, before their next heartbeats refill it.
            for known in self._known.values():
                known.last_seen = now
        else:
            for record in snapshot.workers:
                self._see(record, now)
            for worker_id, known in list(self._known.items()):
                if now - known.last_seen > self._keep_missing_s:
                    await self._forget(worker_id, known)
            listed = {r.worker_id for r in snapshot.workers}
            self._foreign &= listed  # bounded by the registry, not by worker churn
            self._suspect_until = {w: t for w, t in self._suspect_until.items() if t > now}
        await asyncio.gather(*(self._check_health(w, k) for w, k in list(self._known.items())))

    async def _forget(self, worker_id: str, known: _Known) -> None:
        """``worker_id`` left the registry for good: not routable; its channel is closed
        now if the router has no call on it, else at a later refresh once it has none."""
        calls = self._inflight.get(worker_id, 0) + len(self._calls.get(worker_id, ()))
        if calls:
            if not known.gone:
                logger.warning("worker %s left the registry; keeping its channel while %d "
                               "of its calls are in flight", worker_id, calls)
            known.gone = True
            return
        del self._known[worker_id]
        self._heard_from.pop(worker_id, None)
        self._rates.pop(worker_id, None)
        logger.info("worker %s left the registry; closing its channel", worker_id)
        await known.channel.close()

    async def _check_health(self, worker_id: str, known: _Known) -> None:
        try:
            reply = await health_pb2_grpc.HealthStub(known.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self._health_timeout_s)
            serving, why = reply.status == health_pb2.HealthCheckResponse.SERVING, "NOT_SERVING"
            hung = False
        except grpc.aio.AioRpcError as exc:
            serving, why = False, f"{exc.code().name} {exc.details()}"
            hung = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if serving != known.serving:
            log = logger.info if serving else logger.warning
            log("worker %s is %s", worker_id, "serving" if serving else f"not serving: {why}")
        known.serving = serving
        if hung and self._clock() - self._heard_from.get(worker_id, -1e9) < \
                HUNG_AFTER * self._health_timeout_s:
            hung = False  # its calls keep answering: busy (or our own loop is), not hung
        known.timeouts = known.timeouts + 1 if hung else 0
        if known.timeouts == HUNG_AFTER:  # no answer in time, again: take its calls back.
            # One late answer only stops new requests going there (a busy worker answers
            # promptly: its server never blocks). A worker that answers NOT_SERVING or
            # refuses new calls is draining (its calls finish) or a zombie (it fails them
            # itself); a dead one's calls fail by themselves.
            logger.warning("worker %s missed %d health checks: taking back its %d calls",
                           worker_id, HUNG_AFTER, len(self._calls.get(worker_id, ())))
            for call in list(self._calls.get(worker_id, ())):
                call.cancel()

    def _see(self, record: WorkerRecord, now: float) -> None:
        layout = record.layout
        if (layout.model_fingerprint, layout.protocol_version) != \
                (self._fingerprint, PROTOCOL_VERSION):
            if record.worker_id not in self._foreign:
                self._foreign.add(record.worker_id)
                logger.warning("ignoring worker %s: it serves model fingerprint %s with "
                               "protocol %d, the router serves %s with protocol %d",
                               record.worker_id, layout.model_fingerprint,
                               layout.protocol_version, self._fingerprint, PROTOCOL_VERSION)
            return
        known = self._known.get(record.worker_id)
        if known is None or known.record.grpc_address != record.grpc_address:
            if known is not None:  # a new process under the old id: nothing of the old holds
                task = asyncio.get_running_loop().create_task(known.channel.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
                self._suspect_until.pop(record.worker_id, None)
                self._heard_from.pop(record.worker_id, None)
                self._rates.pop(record.worker_id, None)  # another process, maybe machine
            channel = (grpc.aio.insecure_channel(record.grpc_address, options=CHANNEL_OPTIONS,
                                                 interceptors=self._interceptors)
                       if self._credentials is None else
                       grpc.aio.secure_channel(record.grpc_address, self._credentials,
                                               options=CHANNEL_OPTIONS,
                                               interceptors=self._interceptors))
            logger.info("worker %s (%s, TP %d) at %s", record.worker_id, record.role,
                        record.tensor_parallel_size, record.grpc_address)
            self._known[record.worker_id] = _Known(record, channel, now)
        else:
            if known.gone:
                logger.info("worker %s is back in the registry", record.worker_id)
            if (record.role, record.started_at) != (known.record.role, known.record.started_at):
                self._rates.pop(record.worker_id, None)  # another role, or another process
            known.record, known.last_seen, known.gone = record, now, False

    @property
    def pinned_layout(self) -> KVLayout | None:
        """The cluster fingerprint this router pinned and re-asserts (``WorkerView``)."""
        return self._view.pinned

    @property
    def view_age_s(self) -> float:
        return self._view.age_s()

    @property
    def num_channels(self) -> int:
        return len(self._known)

    def layout(self) -> KVLayout | None:
        """The KV layout the workers share (block size, hash seed), ``None`` if none known."""
        for known in self._known.values():
            if not known.gone:
                return known.record.layout
        return None

    def routable(self, role: str) -> list[WorkerRecord]:
        now = self._clock()
        return [k.record for w, k in sorted(self._known.items())
                if k.record.role == role and k.serving and not k.gone and not k.record.draining
                and self._suspect_until.get(w, 0.0) <= now]

    def records(self) -> list[WorkerRecord]:
        """Every known worker's record (routable or not), but those gone for good."""
        return [k.record for k in self._known.values() if not k.gone]

    def max_decode_blocks(self) -> int:
        """The largest KV pool of any known decode worker (0 if none)."""
        return self.max_blocks("decode")

    def max_blocks(self, role: str) -> int:
        """The largest KV pool of any known worker of ``role`` (0 if none)."""
        return max((k.record.total_kv_blocks for k in self._known.values()
                    if k.record.role == role and not k.gone), default=0)

    # ----------------------------------------------------------------- calls and load

    def mark_failed(self, worker_id: str, why: str) -> None:
        """Skip ``worker_id`` for ``suspect_s`` (a call to it failed as if it were down)."""
        if self._suspect_until.get(worker_id, 0.0) <= self._clock():
            logger.warning("not routing to %s for %.1fs: %s", worker_id, self._suspect_s, why)
        self._suspect_until[worker_id] = self._clock() + self._suspect_s

    def channel(self, worker_id: str) -> grpc.aio.Channel:
        """The open channel to ``worker_id``; ``KeyError`` once it left the registry and
        its channel was closed (a departed worker's channel serves its calls in flight,
        and their aborts, until none is left)."""
        return self._known[worker_id].channel

    def heard_from(self, worker_id: str, prefill_tokens_per_s: float = 0.0) -> None:
        """A call to ``worker_id`` just answered (a streamed chunk, a reply): it is alive;
        a reply carrying the worker's measured prefill rate (> 0) updates the router's."""
        self._heard_from[worker_id] = self._clock()
        self.note_rate(worker_id, prefill_tokens_per_s)

    @contextmanager
    def watched(self, worker_id: str, call: grpc.aio.Call) -> Iterator[None]:
        """While inside, ``call`` is cancelled if ``worker_id`` fails a health check (so a
        hung worker cannot hold a request until its deadline). The caller tells this
        cancel from its own with ``asyncio.current_task().cancelling()``."""
        calls = self._calls.setdefault(worker_id, set())
        calls.add(call)
        try:
            yield
        finally:
            calls.discard(call)
            if not calls:
                del self._calls[worker_id]

    async def close(self) -> None:
        known, self._known = self._known, {}
        await asyncio.gather(*(k.channel.close() for k in known.values()))
        self._thread.shutdown(wait=False)
