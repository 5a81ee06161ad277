"""Sender: the prefill side of the KV data plane, one per prefill rank.

``send()`` queues a request's KV (some or all layers) for the decode worker whose
rendezvous store is at ``dest``; it returns at once, so a prefill rank can call it from
the layer hook for layer l while it computes layer l + 1. ``finish()`` (rank 0 only)
queues the transfer's ``Trailer`` behind its layers for the receiver's rank 0.
``done()`` says, without blocking, whether ``wait()`` would return at once. Each
transfer's states and transitions are ``kvtransfer.send.outgoing``'s; the sender keeps the set
of them. Each route of the plan (``kvtransfer.plan``) has a lane: a thread that exists
while the lane has work, owns the lane's messages in order, and moves them over the
lane's channel (see ``kvtransfer.send.send_lane``). A lane idle for ``idle_timeout_s`` is
forgotten when the next transfer starts, with its connection to the receiver's store (a
decode worker that went away leaves nothing open here).

Ownership of the KV blocks: from the first ``send()`` of a transfer until ``wait()``
returns or raises, or ``abort()`` returns, the sender may read the given blocks of
``kv_cache`` at any moment; the caller keeps them pinned and unchanged. Afterwards the
sender never reads them again (a part whose transfer was aborted meanwhile goes out
marked cancelled, without payload). The caller frees the blocks after that point.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from engine.kvcache.layout import KVLayout
from engine.tp.distributed import StoreAddress, backend_for, connect_store
from engine.tp.sharding import kv_head_range
from kvtransfer.config import TransferConfig
from kvtransfer.errors import ChannelError, LayoutMismatch, TransferError, TransferTimeout
from kvtransfer.plan import check_tp_size, routes_from
from kvtransfer.send.outgoing import Job, Outgoing
from kvtransfer.send.send_lane import (
    FaultHook,
    LaneContext,
    LaneKey,
    SendLane,
    retire_idle_lanes,
)
from kvtransfer.states import TransferState
from kvtransfer.stats import SenderStats
from kvtransfer.transport.buffers import BufferPool
from kvtransfer.transport.channel import read_receiver_info
from kvtransfer.transport.pool import ChannelPool
from kvtransfer.wire.packing import transfer_blocks
from kvtransfer.wire.protocol import ReceiverInfo, Trailer

log = logging.getLogger(__name__)

__all__ = ["FaultHook", "KVSender"]


class KVSender:
    """Pushes KV from this prefill rank (``tp_rank`` of ``tp_size``) to decode workers.

    Contract: transfer ids are unique for the sender's lifetime (a reused id is a
    ``ValueError``). ``wait()`` returns once every layer was sent on every route and the
    receivers acknowledged it, verified; it raises a ``TransferError`` otherwise, within
    about ``config.timeout_s`` of the peer going silent. Open channels never exceed
    ``config.max_channels``.
    """

    def __init__(self, layout: KVLayout, *, tp_rank: int = 0, tp_size: int = 1,
                 name: str = "prefill", config: TransferConfig | None = None,
                 fault_hook: FaultHook | None = None) -> None:
        check_tp_size(layout.num_kv_heads, tp_size)
        self.layout = layout
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.name = name
        self.config = config or TransferConfig()
        self.fault_hook = fault_hook
        self.stats = SenderStats()
        self.pool = ChannelPool(self.config.max_channels, self.config.idle_timeout_s)
        self.buffers = BufferPool(max_free=2 * self.config.max_channels + 2)
        self._lane_context = LaneContext(
            layout=layout, tp_rank=tp_rank, tp_size=tp_size, name=name, config=self.config,
            pool=self.pool, buffers=self.buffers, stats=self.stats, fault_hook=fault_hook,
            forget_peer=self._forget_peer)
        self._cond = threading.Condition()
        self._records: dict[int, Outgoing] = {}
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._lanes: dict[LaneKey, SendLane] = {}
        self._peers: dict[StoreAddress, ReceiverInfo] = {}
        self._resolving: dict[StoreAddress, list[Outgoing]] = {}  # waiting for a peer's info
        self._resolvers: set[threading.Thread] = set()
        self._closed = False

    # ---------------------------------------------------------------- public API

    def send(self, transfer_id: int, kv_cache: torch.Tensor, block_ids: Sequence[int],
             num_tokens: int, dest: StoreAddress, layers: range | None = None) -> None:
        """Queue layers ``layers`` (default: all) of a request's KV for ``dest``.

        ``kv_cache`` is this rank's cache (``[layers, 2, blocks, block_size, local KV
        heads, head_dim]``); the request's tokens ``[0, num_tokens)`` live in
        ``block_ids`` in order. Later calls for the same transfer add other layers
        (same blocks, tokens and destination). Raises ``ValueError`` for bad arguments;
        network failures surface in ``wait()``. The first call for a destination reads
        its advertised layout and TP size on a thread of its own (bounded by
        ``config.timeout_s``): no call ever waits on the network; what is queued meanwhile
        goes out once it is known.
        """
        layers = range(self.layout.num_layers) if layers is None else layers
        if layers.step != 1 or layers.start < 0 or layers.stop > self.layout.num_layers:
            raise ValueError(f"layers {layers} outside [0, {self.layout.num_layers})")
        with self._cond:
            if self._closed:
                raise RuntimeError("sender is closed")
            record = self._records.get(transfer_id)
            if record is None:
                record = self._new_record(transfer_id, kv_cache, block_ids, num_tokens, dest)
            if kv_cache is not record.kv_cache or num_tokens != record.num_tokens \
                    or dest != record.dest:
                raise ValueError(f"transfer {transfer_id}: cache, tokens or destination changed")
            for job in record.queue_layers(layers):
                self._submit(job)

    def finish(self, transfer_id: int, trailer: Trailer) -> None:
        """Queue ``trailer`` for the receiver's rank 0, behind every layer of the transfer
        (on rank 0 only, which always serves a route to receiver rank 0; once, after the
        last ``send()``). ``wait()`` and ``done()`` then include its acknowledgement.
        Raises ``KeyError`` for an unknown transfer, ``ValueError`` when layers are
        missing or a trailer was queued before; a failed transfer ignores it."""
        with self._cond:
            record = self._records.get(transfer_id)
            if record is None:
                raise KeyError(f"unknown transfer {transfer_id}")
            if self.tp_rank != 0:
                raise ValueError(f"transfer {transfer_id}: trailer from rank {self.tp_rank}")
            job = record.queue_trailer(trailer)
            if job is not None:
                self._submit(job)

    def done(self, transfer_id: int) -> bool:
        """True once ``wait()`` would return or raise at once (every queued message
        acknowledged, or the transfer failed). Raises ``KeyError`` if unknown."""
        with self._cond:
            record = self._records.get(transfer_id)
            if record is None:
                raise KeyError(f"unknown transfer {transfer_id}")
            return record.state.is_final

    def wait(self, transfer_id: int, timeout_s: float | None = None) -> None:
        """Block until every layer was sent and acknowledged.

        Raises the transfer's ``TransferError``, or ``TransferTimeout`` after
        ``timeout_s`` (then the transfer is aborted). Without ``timeout_s`` the wait is
        still bounded: queued messages fail within ``config.timeout_s`` of a silent peer,
        and layers not queued yet are waited for at most ``config.timeout_s``. Either
        way the transfer is finished: its blocks are the caller's again, and its id
        cannot be reused.
        """
        start = time.monotonic()
        with self._cond:
            record = self._records.get(transfer_id)
            if record is None:
                raise KeyError(f"unknown transfer {transfer_id}")
            while record.state is TransferState.PENDING:
                deadline = None if timeout_s is None else start + timeout_s
                if record.num_unqueued_layers:
                    unsent = start + self.config.timeout_s
                    deadline = unsent if deadline is None else min(deadline, unsent)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
        if record.state is TransferState.PENDING:
            missing = record.num_unqueued_layers
            why = f"{missing} layers never sent" if missing else "not acknowledged in time"
            record.fail(TransferTimeout(why, transfer_id))
        self._forget(transfer_id)
        if record.error is not None:
            raise record.error

    def abort(self, transfer_id: int) -> bool:
        """Stop a transfer; returns once the sender no longer reads its blocks.
        False if unknown or already finished."""
        record = self._records.get(transfer_id)
        if record is None:
            return False
        record.fail(TransferError("aborted by the sender", transfer_id))
        self._forget(transfer_id)
        return True

    @property
    def num_pending(self) -> int:
        with self._cond:
            return len(self._records)

    @property
    def num_open_channels(self) -> int:
        return len(self.pool)

    def threads(self) -> list[threading.Thread]:
        with self._cond:
            lanes = list(self._lanes.values())
            resolvers = list(self._resolvers)
        return [t for t in (lane.thread for lane in lanes) if t is not None] + resolvers

    def close(self) -> None:
        """Abort every transfer, close every channel and join the lanes' threads."""
        with self._cond:
            self._closed = True
            records = list(self._records.values())
        for record in records:
            self.abort(record.transfer_id)
        self.pool.close_all("sender closed")
        for thread in self.threads():
            thread.join(timeout=self.config.timeout_s)
        self.pool.close_all("sender closed")  # again: one a lane was opening meanwhile
        with self._cond:
            for lane in self._lanes.values():
                lane.drop_store()  # the rendezvous connections
        self.buffers.clear()

    # ---------------------------------------------------------------- internals

    def _new_record(self, transfer_id: int, kv_cache: torch.Tensor, block_ids: Sequence[int],
                    num_tokens: int, dest: StoreAddress) -> Outgoing:
        """A new transfer (lock held): its routes now if the receiver is known, else once
        the resolver thread of ``dest`` read its advertisement."""
        if transfer_id in self._finished:
            raise ValueError(f"transfer id {transfer_id} was used before")
        check_cache(self.layout, self.tp_rank, self.tp_size, kv_cache)
        ids = transfer_blocks(num_tokens, list(block_ids), self.layout.block_size,
                              kv_cache.shape[2])
        num_blocks = len(ids)
        record = Outgoing(
            transfer_id=transfer_id, dest=dest, kv_cache=kv_cache,
            block_ids=torch.tensor(ids, dtype=torch.int64, device=kv_cache.device),
            num_tokens=num_tokens, num_blocks=num_blocks, num_layers=self.layout.num_layers,
            changed=self._cond)
        self._records[transfer_id] = record
        retire_idle_lanes(self._lanes, self._peers, self.config.idle_timeout_s)
        peer = self._peers.get(dest)
        if peer is not None:
            self._resolve(record, peer)
        else:
            waiting = self._resolving.get(dest)
            if waiting is None:
                waiting = self._resolving[dest] = []
                thread = threading.Thread(target=self._resolver, args=(dest,), daemon=True,
                                          name=f"kvtransfer-resolve-{dest.port}")
                self._resolvers.add(thread)
                thread.start()
            waiting.append(record)
        return record

    def _resolver(self, dest: StoreAddress) -> None:
        """Read ``dest``'s advertisement, then route every transfer waiting for it."""
        peer = self._peers.get(dest) or read_peer(dest, self.layout, self.config)
        with self._cond:
            if isinstance(peer, ReceiverInfo):
                self._peers[dest] = peer  # cached until a lane's channel to it breaks
            waiting = self._resolving.pop(dest, [])
            self._resolvers.discard(threading.current_thread())
            for record in waiting:
                self._resolve(record, peer)

    def _resolve(self, record: Outgoing, peer: ReceiverInfo | TransferError) -> None:
        """Route ``record`` to ``peer`` and submit what it queued meanwhile (lock held)."""
        try:
            if not isinstance(peer, ReceiverInfo):
                raise peer
            routes = routes_from(self.layout.num_kv_heads, self.tp_rank, self.tp_size,
                                 peer.tp_size)
        except (TransferError, ValueError) as exc:
            err = exc if isinstance(exc, TransferError) else LayoutMismatch(str(exc))
            record.fail(type(err)(str(err), record.transfer_id))
            record.resolve(0, [])
            return
        for job in record.resolve(peer.tp_size, routes):
            self._submit(job)

    def _submit(self, job: Job) -> None:
        """Queue ``job`` on its route's lane, starting the lane's thread if needed."""
        key = LaneKey(job.record.dest, job.route.receiver_rank)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = SendLane(self._lane_context, key,
                                               backend_for(job.record.kv_cache.device))
        lane.submit(job)

    @property
    def num_lanes(self) -> int:
        """Routes with a lane: each holds a connection to its receiver's store."""
        with self._cond:
            return len(self._lanes)

    def _forget_peer(self, dest: StoreAddress) -> None:
        """A lane's channel to ``dest`` broke: re-read its layout before the next transfer."""
        with self._cond:
            self._peers.pop(dest, None)

    def _forget(self, transfer_id: int) -> None:
        with self._cond:
            if self._records.pop(transfer_id, None) is not None:
                self._finished[transfer_id] = None
                while len(self._finished) > self.config.remember_finished:
                    self._finished.popitem(last=False)


def check_cache(layout: KVLayout, tp_rank: int, tp_size: int, kv_cache: torch.Tensor) -> None:
    """``ValueError`` unless ``kv_cache`` is rank ``tp_rank``'s shard of ``layout``'s cache
    ``[layers, 2, blocks, block_size, local heads, head_dim]``, contiguous, of its dtype."""
    start, end = kv_head_range(layout.num_kv_heads, tp_rank, tp_size)
    want = (layout.num_layers, 2, layout.block_size, end - start, layout.slot_width)
    got = tuple(kv_cache.shape[:2]) + tuple(kv_cache.shape[3:])
    if kv_cache.dim() != 6 or got != want or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache of shape {tuple(kv_cache.shape)} does not match the "
                         f"layout [layers, 2, blocks, block_size, heads, head_dim] = {want}")
    if str(kv_cache.dtype).removeprefix("torch.") != layout.cache_dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != layout dtype {layout.cache_dtype}")


def read_peer(dest: StoreAddress, layout: KVLayout, config: TransferConfig
              ) -> ReceiverInfo | TransferError:
    """The receiving worker's advertised layout and TP size, read from its store, or why
    not (unreachable, a layout other than ``layout``, an advertisement it cannot parse);
    never raises: the resolver thread hands the answer to every transfer waiting for it."""
    try:
        store = connect_store(dest, timeout_s=config.timeout_s)
        info = read_receiver_info(store, config.timeout_s)
    except ValueError as exc:  # another protocol version, or not an advertisement at all
        return LayoutMismatch(f"decode worker at {dest.host}:{dest.port} advertises what this "
                              f"sender cannot read (another pdserve version?): "
                              f"{str(exc).splitlines()[0][:200]}")
    except RuntimeError as exc:
        return ChannelError(f"decode worker at {dest.host}:{dest.port} unreachable: "
                            f"{str(exc).splitlines()[0][:200]}")
    except Exception as exc:  # noqa: BLE001 - the transfers waiting for it must hear of it
        log.exception("reading the advertisement of %s:%d failed", dest.host, dest.port)
        return ChannelError(f"decode worker at {dest.host}:{dest.port}: its advertisement "
                            f"could not be read: {exc!r}"[:300])
    diff = layout.diff(info.layout)
    if diff is not None:
        return LayoutMismatch(f"decode worker at {dest.host}:{dest.port} has another "
                              f"KV layout: {diff} (sender != receiver)")
    return info
