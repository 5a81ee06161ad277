"""One incoming transfer on a decode rank, and every transition of its state machine.

``Incoming`` is PENDING from ``KVReceiver.expect`` until it is DONE (every layer's rows
of this rank's heads, and — when it wants one — the sender's ``Trailer``, arrived and
verified) or FAILED (a bad or corrupted part, a cancelled send, a broken channel, an
abort, or its deadline). Its deadline: its first part must arrive by ``start_deadline``
(a queue of prefills ahead of it costs no timeout); from then on it must complete
within ``timeout_s``. Every transition happens here, under the transfer's ``lock``,
which is also held while its blocks are written: once a transition to FAILED returned,
no block of it is written again. The receiver (``kvtransfer.receive.receiver``) keeps the set of
transfers and wakes their waiters; channels (``kvtransfer.receive.recv_channel``) hand parts to
``deliver``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from engine.kvcache.layout import KVLayout
from engine.tp.sharding import kv_head_range
from kvtransfer.errors import ChecksumMismatch, TransferError, TransferRejected, TransferTimeout
from kvtransfer.plan import local_heads
from kvtransfer.states import TransferState
from kvtransfer.stats import ReceiverStats
from kvtransfer.wire.checksum import checksum
from kvtransfer.wire.packing import scatter_from_wire, segments
from kvtransfer.wire.protocol import ChecksumAlgo, Flag, Kind, PartHeader, Status, Trailer


@dataclass(frozen=True)
class RankShard:
    """Which part of the KV a receiving rank holds: its rank and the layout's heads."""

    layout: KVLayout
    tp_rank: int
    tp_size: int

    @property
    def heads(self) -> tuple[int, int]:
        return kv_head_range(self.layout.num_kv_heads, self.tp_rank, self.tp_size)


@dataclass
class Incoming:
    """One expected transfer (see module doc). ``lock`` is held while its blocks are written."""

    transfer_id: int
    kv_cache: torch.Tensor
    block_ids: torch.Tensor  # [num_blocks] int64 on kv_cache's device
    num_tokens: int
    num_blocks: int
    start_deadline: float  # monotonic: the first part must have arrived by then
    timeout_s: float  # from its first part to its completion
    units_per_layer: int  # (K|V, block, head) slabs each layer needs
    units: list[int]
    wants_trailer: bool = False  # complete only once the sender's trailer arrived too
    seen: set[tuple[int, ...]] = field(default_factory=set)
    channels: set[int] = field(default_factory=set)
    trailer: Trailer | None = None
    state: TransferState = TransferState.PENDING
    error: TransferError | None = None
    started_at: float | None = None  # monotonic: when its first part arrived
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def deadline(self) -> float:
        """When it fails unless complete: ``start_deadline`` until its first part arrived,
        then ``timeout_s`` after that."""
        return self.start_deadline if self.started_at is None else self.started_at + self.timeout_s

    @property
    def layers_complete(self) -> bool:
        return all(u >= self.units_per_layer for u in self.units)

    # ------------------------------------------------------------ transitions

    def fail(self, error: TransferError) -> bool:
        """PENDING → FAILED with ``error``; False if it had ended already. No block of it
        is written after this returns."""
        with self.lock:
            if self.state is not TransferState.PENDING:
                return False
            self.error = error  # before the state: a reader seeing FAILED sees why
            self.state = TransferState.FAILED
            return True

    def time_out(self) -> bool:
        """At its deadline: PENDING → FAILED naming what was missing."""
        if self.started_at is None:
            what = "no part arrived"
        else:
            what = "trailer (first token) missing" if self.layers_complete else "KV incomplete"
        return self.fail(TransferTimeout(f"{what} at the deadline", self.transfer_id))

    def deliver(self, shard: RankShard, header: PartHeader, payload: torch.Tensor,
                channel_id: int, stats: ReceiverStats) -> tuple[Status, list[int]]:
        """Verify one part of this transfer and write it into its blocks (a trailer part
        is checked and kept). Returns the status to acknowledge it with and the layers it
        completed."""
        check = _check_trailer if header.kind == Kind.TRAILER else _check_part
        problem = check(shard, header, self)
        if problem is not None:
            self.fail(TransferRejected(f"invalid part: {problem}", self.transfer_id))
            return Status.BAD_PART, []
        if header.flags & Flag.CANCELLED:
            self.fail(TransferRejected("the sender aborted the transfer", self.transfer_id))
            return Status.NOT_EXPECTED, []
        if header.kind == Kind.TRAILER:
            return self._keep_trailer(header, channel_id, stats), []
        if checksum(payload, ChecksumAlgo(header.checksum_algo)) != header.checksum % (1 << 64):
            stats.checksum_failures += 1
            self.fail(ChecksumMismatch(f"payload of part {header.seq} corrupted",
                                       self.transfer_id))
            return Status.CHECKSUM_MISMATCH, []
        return self._write(shard, header, payload, channel_id, stats)

    def _write(self, shard: RankShard, header: PartHeader, payload: torch.Tensor,
               channel_id: int, stats: ReceiverStats) -> tuple[Status, list[int]]:
        key = (header.layer_start, header.layer_end, header.row_start, header.row_end,
               header.head_start, header.head_end)
        lay = shard.layout
        with self.lock:
            status = self._settled_status(stats)
            if status is not None:
                return status, []
            if key in self.seen:
                stats.duplicate_parts += 1
                return Status.OK, []
            heads = local_heads(lay.num_kv_heads, shard.tp_rank, shard.tp_size,
                                header.head_start, header.head_end)
            rows = (header.row_start, header.row_end)
            scatter_from_wire(self.kv_cache, self.block_ids, heads, header.layer_start,
                              self.num_blocks, rows, payload, lay)
            self.seen.add(key)
            self.channels.add(channel_id)
            completed = []
            for seg in segments(header.layer_start, self.num_blocks, *rows):
                before = self.units[seg.layer]
                self.units[seg.layer] += (seg.block_end - seg.block_start) * (
                    header.head_end - header.head_start)
                if before < self.units_per_layer <= self.units[seg.layer]:
                    completed.append(seg.layer)
            self._settle_if_complete()
        return Status.OK, completed

    def _keep_trailer(self, header: PartHeader, channel_id: int, stats: ReceiverStats
                      ) -> Status:
        with self.lock:
            status = self._settled_status(stats)
            if status is not None:
                return status
            if self.trailer is not None:
                stats.duplicate_parts += 1
                return Status.OK
            self.trailer = header.trailer
            self.channels.add(channel_id)
            self._settle_if_complete()
        return Status.OK

    def _settled_status(self, stats: ReceiverStats) -> Status | None:
        """The status for a part of a transfer that ended (lock held; a transfer past its
        deadline fails here), or None while it is pending."""
        now = time.monotonic()
        if self.state is TransferState.PENDING and now > self.deadline:
            self.error = TransferTimeout("KV incomplete at the deadline", self.transfer_id)
            self.state = TransferState.FAILED
            return Status.NOT_EXPECTED
        if self.state is TransferState.PENDING:
            if self.started_at is None:
                self.started_at = now  # the transfer started: it now has timeout_s to finish
            return None
        stats.late_parts += 1
        return Status.DONE_BEFORE if self.state is TransferState.DONE else Status.NOT_EXPECTED

    def _settle_if_complete(self) -> None:
        """Every layer (and the trailer, when wanted) is in: PENDING → DONE (lock held)."""
        if self.layers_complete and (self.trailer is not None or not self.wants_trailer):
            self.state = TransferState.DONE


def _check_trailer(shard: RankShard, header: PartHeader, record: Incoming) -> str | None:
    """Why trailer ``header`` cannot belong to ``record`` on this rank (None when it can)."""
    mismatch = header.check_layout(shard.layout)
    if mismatch is not None:
        return f"KV layout differs: {mismatch}"
    if not record.wants_trailer:
        return (f"a trailer for transfer {record.transfer_id}, which has none on rank "
                f"{shard.tp_rank}")
    if header.num_tokens != record.num_tokens or header.payload_nbytes:
        return f"trailer of {header.num_tokens} tokens with {header.payload_nbytes} payload bytes"
    # the sender's cached count covers the whole prompt, of which the receiver may hold
    # leading blocks already (not sent): the worker checks it against the prompt
    if header.first_token_id < 0 or header.num_cached_tokens < 0:
        return f"trailer {header.trailer} out of range"
    return None


def _check_part(shard: RankShard, header: PartHeader, record: Incoming) -> str | None:
    """Why ``header`` cannot belong to ``record`` on this rank (None when it can)."""
    lay = shard.layout
    mismatch = header.check_layout(lay)
    if mismatch is not None:
        return f"KV layout differs: {mismatch}"
    if header.num_tokens != record.num_tokens:
        return f"num_tokens {header.num_tokens} != expected {record.num_tokens}"
    if not 0 <= header.layer_start < header.layer_end <= lay.num_layers:
        return f"layers [{header.layer_start}, {header.layer_end})"
    try:
        local_heads(lay.num_kv_heads, shard.tp_rank, shard.tp_size, header.head_start,
                    header.head_end)
    except ValueError as exc:
        return str(exc)
    num_rows = (header.layer_end - header.layer_start) * 2 * record.num_blocks
    if not 0 <= header.row_start < header.row_end <= num_rows:
        return f"rows [{header.row_start}, {header.row_end}) of {num_rows}"
    nbytes = (header.row_end - header.row_start) * lay.row_bytes(header.head_end - header.head_start)
    if not header.flags & Flag.CANCELLED and header.payload_nbytes != nbytes:
        return f"payload of {header.payload_nbytes} bytes, expected {nbytes}"
    return None
