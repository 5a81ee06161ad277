"""Receiver: the decode side of the KV data plane, one per decode rank.

The decode worker's rank 0 hosts the rendezvous store (``TCPStore``) and advertises its
KV layout and TP size there (``ReceiverInfo``); every rank's receiver accepts channels
from prefill ranks through it (an accept thread per rank) and reads each channel on its
own thread (``kvtransfer.receive.recv_channel``). ``expect()`` announces a transfer: where its KV
goes, and (on rank 0) whether a ``Trailer`` completes it; ``wait()`` returns that trailer
once everything arrived. Each transfer's states and transitions are ``kvtransfer.receive.incoming``'s;
the receiver keeps the set of them, resolves parts to them and wakes their waiters.

Ownership of the KV blocks: from ``expect()`` until ``wait()`` returns or raises, or
``abort()`` returns, the receiver may write the given blocks of ``kv_cache`` at any
moment; the caller must neither use them as KV nor free them. Afterwards the receiver
never writes them again. Only after ``wait()`` returns normally do the blocks hold the
transfer's KV (every payload verified before it was written); after a failure they
hold unspecified bytes and the caller frees them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engine.kvcache.layout import KVLayout
from engine.tp.distributed import StoreAddress, backend_for, create_store_server
from kvtransfer.config import TransferConfig
from kvtransfer.errors import ChannelError, TransferError, TransferRejected, TransferTimeout
from kvtransfer.plan import check_tp_size
from kvtransfer.receive.accept import Acceptor
from kvtransfer.receive.incoming import Incoming, RankShard
from kvtransfer.receive.recv_channel import RecvChannel
from kvtransfer.states import TransferState
from kvtransfer.stats import ReceiverStats
from kvtransfer.transport.channel import Channel, advertise
from kvtransfer.transport.pool import ChannelPool
from kvtransfer.wire.packing import transfer_blocks
from kvtransfer.wire.protocol import PartHeader, ReceiverInfo, Status, Trailer

log = logging.getLogger(__name__)


class KVReceiver:
    """Receives KV into this decode rank (``tp_rank`` of ``tp_size``).

    ``store_address``: where the worker's rendezvous store listens. With ``host_store``
    (default: rank 0) this receiver starts it there (port 0 = any) and advertises the
    layout; ``address`` is where others reach it (``advertise_host``, when the store
    listens on a wildcard, and the port it got); other ranks connect to ``leader.address``.
    Contract: transfer ids are never reused; parts for finished or unknown transfers
    are ignored and counted (``stats``); open channels never exceed
    ``config.max_channels`` (a sender asking for more is told to retry).
    ``on_layer_received(transfer_id, layer)``, if given, is called on a channel thread
    once a layer of a transfer is complete and verified in this rank's blocks (for
    tests' observations; it must return quickly).
    """

    def __init__(self, layout: KVLayout, store_address: StoreAddress, *, tp_rank: int = 0,
                 tp_size: int = 1, host_store: bool | None = None,
                 device: str | torch.device = "cpu", config: TransferConfig | None = None,
                 on_layer_received: Callable[[int, int], None] | None = None,
                 advertise_host: str | None = None) -> None:
        check_tp_size(layout.num_kv_heads, tp_size)
        self.layout = layout
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.shard = RankShard(layout, tp_rank, tp_size)
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.config = config or TransferConfig()
        self.stats = ReceiverStats()
        self.on_layer_received = on_layer_received
        self.pool = ChannelPool(self.config.max_channels, self.config.idle_timeout_s)
        self.cond = threading.Condition()
        self._expected: dict[int, Incoming] = {}
        self._finished: OrderedDict[int, bool] = OrderedDict()  # id -> completed
        self._dropped: OrderedDict[int, bool] = OrderedDict()  # never expected in time
        self._channels: dict[int, RecvChannel] = {}
        self._ending: list[threading.Thread] = []  # ended channels' threads, till they exit
        self._closed = False
        self._server: Any = None
        if tp_rank == 0 if host_store is None else host_store:
            self._server = create_store_server(store_address.host, store_address.port,
                                               timeout_s=self.config.timeout_s)
            store_address = StoreAddress(advertise_host or store_address.host,
                                         int(self._server.port))
            advertise(self._server, ReceiverInfo(layout, tp_size))
        self.address = store_address
        self._acceptor = Acceptor(store_address, tp_rank=tp_rank, layout=layout,
                                  tp_size=tp_size, backend=self.backend, device=self.device,
                                  config=self.config, pool=self.pool, stats=self.stats,
                                  adopt=self._adopt, closed=lambda: self._closed)

    # ---------------------------------------------------------------- public API

    def expect(self, transfer_id: int, kv_cache: torch.Tensor, block_ids: Sequence[int],
               num_tokens: int, timeout_s: float | None = None, *, trailer: bool = False,
               start_timeout_s: float | None = None) -> None:
        """Announce a transfer: its tokens ``[0, num_tokens)`` go into ``block_ids`` (in
        order) of this rank's ``kv_cache``, all layers, this rank's KV heads. It fails
        unless its first part arrives within ``start_timeout_s`` (default: ``timeout_s``)
        and it completes within ``timeout_s`` (default ``config.timeout_s``) of that. With
        ``trailer`` (rank 0 only: senders send trailers there) it is complete only once
        the sender's ``Trailer`` arrived as well."""
        ids = transfer_blocks(num_tokens, list(block_ids), self.layout.block_size,
                              kv_cache.shape[2])
        num_blocks = len(ids)
        start, end = self.shard.heads
        if kv_cache.dim() != 6 or kv_cache.shape[4] != end - start:
            raise ValueError(f"kv_cache of shape {tuple(kv_cache.shape)}: expected "
                             f"{end - start} local KV heads on axis 4")
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        start_timeout = timeout if start_timeout_s is None else start_timeout_s
        record = Incoming(
            transfer_id=transfer_id, kv_cache=kv_cache,
            block_ids=torch.tensor(ids, dtype=torch.int64, device=kv_cache.device),
            num_tokens=num_tokens, num_blocks=num_blocks,
            start_deadline=time.monotonic() + start_timeout, timeout_s=timeout,
            units_per_layer=2 * num_blocks * (end - start), units=[0] * self.layout.num_layers,
            wants_trailer=trailer)
        with self.cond:
            if self._closed:
                raise RuntimeError("receiver is closed")
            if transfer_id in self._expected or transfer_id in self._finished:
                raise ValueError(f"transfer id {transfer_id} was used before")
            if transfer_id in self._dropped:  # its parts came too early and were ignored
                record.fail(TransferRejected(
                    f"parts arrived more than {self.config.park_s:.1f}s before expect() and "
                    "were dropped", transfer_id))
            self._expected[transfer_id] = record
            self.cond.notify_all()

    def wait(self, transfer_id: int, timeout_s: float | None = None) -> Trailer | None:
        """Block until the transfer's KV is complete and verified in its blocks; returns
        its trailer (None unless ``expect`` asked for one).

        Raises its ``TransferError`` (``TransferTimeout`` at its deadline, or after
        ``timeout_s``). Either way the transfer is finished and its blocks are the
        caller's again."""
        with self.cond:
            record = self._expected.get(transfer_id)
            if record is None:
                raise KeyError(f"unknown transfer {transfer_id}")
            limit = None if timeout_s is None else time.monotonic() + timeout_s
            while record.state is TransferState.PENDING:
                # the deadline moves once the transfer starts: read it each time
                deadline = record.deadline if limit is None else min(record.deadline, limit)
                if time.monotonic() >= deadline:
                    break
                self.cond.wait(deadline - time.monotonic())
        if record.state is TransferState.PENDING and record.time_out():
            # (not when its last part landed since the check: its channels are sound)
            self._notify(True)
            self._close_stalled(record)
        self._forget(record)
        if record.state is not TransferState.DONE:
            raise record.error or TransferTimeout("ended without its KV", transfer_id)
        return record.trailer

    def done(self, transfer_id: int) -> bool:
        """True once ``wait()`` would return or raise without blocking."""
        record = self._expected.get(transfer_id)
        if record is None:
            raise KeyError(f"unknown transfer {transfer_id}")
        return record.state.is_final or time.monotonic() >= record.deadline

    def abort(self, transfer_id: int) -> bool:
        """Stop a transfer; returns once no block of it is written any more. A transfer
        not expected (yet) is refused: its parts are ignored, those parked waiting for its
        ``expect()`` at once, and ``expect()`` of it raises. False unless it was expected."""
        record = self._expected.get(transfer_id)
        if record is None:
            with self.cond:
                if transfer_id not in self._expected and transfer_id not in self._finished:
                    self._remember(self._finished, transfer_id, False)
                    self.cond.notify_all()
            return False
        self.fail(record, TransferRejected("aborted by the receiver", transfer_id))
        self._forget(record)
        return True

    @property
    def num_pending(self) -> int:
        with self.cond:
            return len(self._expected)

    @property
    def num_open_channels(self) -> int:
        return len(self.pool)

    def threads(self) -> list[threading.Thread]:
        with self.cond:
            self._ending = [t for t in self._ending if t.is_alive()]
            found = [t for c in self._channels.values() for t in c.threads()] + self._ending
        return [*self._acceptor.threads(), *(t for t in found if t.is_alive())]

    def close(self) -> None:
        """Stop accepting, close every channel, fail what is pending, join all threads."""
        with self.cond:
            self._closed = True
            records = list(self._expected.values())
            self.cond.notify_all()
        for record in records:
            self.abort(record.transfer_id)
        self._acceptor.join(timeout_s=10)
        self.pool.close_all("receiver closed")
        for thread in self.threads():
            thread.join(timeout=10)
        self._server = None

    # ---------------------------------------------------------------- used by channels

    def fail(self, record: Incoming, error: TransferError) -> None:
        """Fail a pending transfer; no block of it is written after this returns."""
        self._notify(record.fail(error))

    def resolve(self, header: PartHeader) -> Incoming | Status:
        """The transfer a part belongs to, or the status to acknowledge it with when it
        is ignored. A part of a transfer not yet expected waits ``config.park_s`` for
        its ``expect()``."""
        deadline = time.monotonic() + self.config.park_s
        with self.cond:
            while True:
                record = self._expected.get(header.transfer_id)
                if record is not None:
                    return record
                completed = self._finished.get(header.transfer_id)
                if completed is not None:
                    self.stats.late_parts += 1
                    return Status.DONE_BEFORE if completed else Status.NOT_EXPECTED
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0 or header.transfer_id in self._dropped:
                    self.stats.unknown_parts += 1
                    self._remember(self._dropped, header.transfer_id, True)
                    return Status.NOT_EXPECTED
                self.cond.wait(remaining)

    def deliver(self, header: PartHeader, payload: torch.Tensor, record: Incoming,
                channel_id: int) -> Status:
        """Hand a resolved part to its transfer; wake waiters; report completed layers."""
        status, completed = record.deliver(self.shard, header, payload, channel_id, self.stats)
        self._notify(True)
        if self.on_layer_received is not None:
            for layer in completed:
                self.on_layer_received(record.transfer_id, layer)
        return status

    def channel_closed(self, channel_id: int, reason: str | None) -> None:
        """A channel ended; with a ``reason`` (it broke), its unfinished transfers fail."""
        with self.cond:
            ended = self._channels.pop(channel_id, None)
            if ended is not None:  # its thread runs on a moment (it is calling this)
                self._ending = [t for t in self._ending if t.is_alive()] + ended.threads()
            affected = [r for r in self._expected.values()
                        if r.state is TransferState.PENDING and channel_id in r.channels]
        for record in affected:
            if reason is not None:
                self.fail(record, ChannelError(reason, record.transfer_id))

    # ---------------------------------------------------------------- internals

    def _adopt(self, channel_id: int, channel: Channel) -> RecvChannel | None:
        """An accepted channel's reader (``kvtransfer.receive.accept``), or None once closed."""
        reader = RecvChannel(self, channel_id, channel)
        with self.cond:  # close() sees the reader or the joiner thread, never neither
            if self._closed:
                return None
            self._channels[channel_id] = reader
        return reader

    def _close_stalled(self, record: Incoming) -> None:
        """A transfer that stopped mid-way: its sender is presumed hung; cut its channels."""
        for channel in self.pool.open_channels():
            if channel.channel_id in record.channels:
                channel.close(f"stalled: transfer {record.transfer_id} incomplete at its deadline")

    def _notify(self, changed: bool) -> None:
        if changed:
            with self.cond:
                self.cond.notify_all()

    def _forget(self, record: Incoming) -> None:
        with self.cond:
            if self._expected.pop(record.transfer_id, None) is not None:
                self._remember(self._finished, record.transfer_id,
                               record.state is TransferState.DONE)

    def _remember(self, ids: OrderedDict[int, bool], transfer_id: int, value: bool) -> None:
        """Record an id in a bounded, oldest-first-forgotten map (lock held)."""
        ids[transfer_id] = value
        while len(ids) > self.config.remember_finished:
            ids.popitem(last=False)
