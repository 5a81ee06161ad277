"""The receiving end of one channel: one thread, and a ring of receives posted ahead.

The thread takes the parts in order (0, 1, ...). Each arrives whole (header and payload
in one message, or on nccl the payload right after) into one of the ``RECV_DEPTH``
buffers the ring keeps posted, so the sender never waits for a "ready to receive"
round trip. Between messages the wait is up to ``idle_timeout_s`` (the channel then
closes itself), within a message up to ``timeout_s``. Each part is resolved to its
transfer, verified, written into the transfer's blocks, and each message's last part
acknowledged; then its buffer is posted again for a later part.

Ownership: the channel belongs to the receiver's pool and counts as borrowed (never
closed to make room) from a message's first part to its last. The ring's buffers
belong to this thread; blocks are written only under the transfer's lock while it is
active (see ``KVReceiver``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvtransfer.channel import Channel, Pending
from kvtransfer.checksum import checksum
from kvtransfer.errors import ChannelError, ChecksumMismatch, TransferRejected, TransferTimeout
from kvtransfer.packing import rows_view, scatter, segments
from kvtransfer.plan import local_heads
from kvtransfer.protocol import (
    HEADER_BYTES,
    Ack,
    ChecksumAlgo,
    Flag,
    Kind,
    OpenRequest,
    PartHeader,
    Status,
)

if TYPE_CHECKING:
    from kvtransfer.receiver import Incoming, KVReceiver

log = logging.getLogger(__name__)

RECV_DEPTH = 3  # parts received ahead of the one being handled
_SEVERITY = [Status.OK, Status.DONE_BEFORE, Status.NOT_EXPECTED, Status.BAD_PART,
             Status.CHECKSUM_MISMATCH]


class RecvRing:
    """Receives of the channel's next parts, each posted into its own buffer."""

    def __init__(self, channel: Channel, depth: int, max_part_bytes: int) -> None:
        self.channel = channel
        room = HEADER_BYTES if channel.split_payload else HEADER_BYTES + max_part_bytes
        self.buffers = [torch.empty(room, dtype=torch.uint8) for _ in range(depth)]
        self.ops: dict[int, Pending] = {}
        for seq in range(depth):
            self.ops[seq] = channel.recv_part(seq, self.buffers[seq])

    def wait(self, seq: int, timeout_s: float) -> tuple[PartHeader, torch.Tensor]:
        """Part ``seq``'s header and buffer; ``ValueError`` if the header is malformed."""
        op = self.ops.pop(seq)
        self.channel.wait(op, timeout_s)
        words = op.tensor[:HEADER_BYTES].view(torch.int64)[: PartHeader.WORDS].tolist()
        header = PartHeader.decode(words)
        if header.seq != seq:
            raise ValueError(f"part {header.seq} where {seq} was due")
        if not self.channel.split_payload and HEADER_BYTES + header.payload_nbytes > op.tensor.numel():
            raise ValueError(f"part of {header.payload_nbytes} bytes exceeds the buffer")
        return header, op.tensor

    def repost(self, seq: int) -> None:
        """Part ``seq``'s buffer is free: post it for part ``seq + depth``."""
        depth = len(self.buffers)
        self.ops[seq + depth] = self.channel.recv_part(seq + depth, self.buffers[seq % depth])


class RecvChannel:
    """The thread and state of one accepted channel (see module doc)."""

    def __init__(self, receiver: KVReceiver, request: OpenRequest, channel: Channel) -> None:
        self.receiver = receiver
        self.request = request
        self.channel_id = request.channel_id
        self.channel = channel
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvtransfer-recv-{self.channel_id}")

    def start(self) -> None:
        self._thread.start()

    def threads(self) -> list[threading.Thread]:
        return [self._thread]

    def _run(self) -> None:
        rx = self.receiver
        reason: str | None = "receiver failed"
        try:
            ring = RecvRing(self.channel, RECV_DEPTH, rx.config.part_bytes)
            reason = self._loop(ring)
        except ChannelError as exc:
            reason = str(exc) if self.channel.closed_by_error else None
        except ValueError as exc:
            reason = f"protocol error: {exc}"
        finally:
            rx.pool.discard(self.channel, reason or "closed")
            rx.channel_closed(self, reason)

    def _loop(self, ring: RecvRing) -> str | None:
        """Handle parts until the channel ends: None when it was closed on purpose."""
        rx, cfg = self.receiver, self.receiver.config
        seq, mid_message, message_status = 0, False, Status.OK
        while True:
            header, buffer = ring.wait(seq, cfg.timeout_s if mid_message else cfg.idle_timeout_s)
            if seq == 0:
                self.channel.forget_rendezvous()
            if header.kind == Kind.CLOSE:
                self._acknowledge(header, Status.OK)
                return None
            if not mid_message and rx.pool.checkout(self.channel_id) is None:
                return None  # closed meanwhile (to make room, or idle)
            status = self._handle(header, buffer)
            message_status = max(message_status, status, key=_SEVERITY.index)
            if header.is_last:
                self._acknowledge(header, message_status)
                message_status = Status.OK
                rx.pool.checkin(self.channel)
            ring.repost(seq)
            mid_message = not header.is_last
            seq += 1

    def _handle(self, header: PartHeader, buffer: torch.Tensor) -> Status:
        """Resolve, receive (split payloads), verify and write one part: its status."""
        rx = self.receiver
        target = rx.resolve(header)
        try:
            payload = self._payload(header, buffer, target)
        except ChannelError:
            if not isinstance(target, Status):
                rx.fail(target, ChannelError("channel broke mid-part", header.transfer_id))
            raise
        rx.stats.parts_received += 1
        rx.stats.bytes_received += header.payload_nbytes
        if isinstance(target, Status):
            return target
        return rx.deliver(header, payload, target, self.channel_id)

    def _payload(self, header: PartHeader, buffer: torch.Tensor, target: Incoming | Status
                 ) -> torch.Tensor:
        end = HEADER_BYTES + header.payload_nbytes
        if not self.channel.split_payload or not header.payload_nbytes:
            return buffer[HEADER_BYTES:end]
        device = self.receiver.device if isinstance(target, Status) else target.kv_cache.device
        payload = torch.empty(header.payload_nbytes, dtype=torch.uint8, device=device)
        self.channel.wait(self.channel.recv_payload(payload, header.seq),
                          self.receiver.config.timeout_s)
        return payload

    def _acknowledge(self, header: PartHeader, status: Status) -> None:
        op = self.channel.send_ack(Ack(header.transfer_id, header.seq, status))
        self.channel.wait(op, self.receiver.config.timeout_s)


def deliver_part(rx: KVReceiver, header: PartHeader, payload: torch.Tensor, record: Incoming,
                 channel_id: int) -> Status:
    """Verify one part of ``record`` and write it into its blocks (the receiver's side
    of ``KVReceiver.deliver``); a trailer part is checked and kept."""
    problem = (_check_trailer if header.kind == Kind.TRAILER else _check_part)(rx, header, record)
    if problem is not None:
        rx.fail(record, TransferRejected(f"invalid part: {problem}", record.transfer_id))
        return Status.BAD_PART
    if header.flags & Flag.CANCELLED:
        rx.fail(record, TransferRejected("the sender aborted the transfer", record.transfer_id))
        return Status.NOT_EXPECTED
    if header.kind == Kind.TRAILER:
        return _keep_trailer(rx, header, record, channel_id)
    if checksum(payload, ChecksumAlgo(header.checksum_algo)) != header.checksum % (1 << 64):
        rx.stats.checksum_failures += 1
        rx.fail(record, ChecksumMismatch(f"payload of part {header.seq} corrupted",
                                         record.transfer_id))
        return Status.CHECKSUM_MISMATCH
    status, completed = _write(rx, header, payload, record, channel_id)
    if rx.on_layer_received is not None:
        for layer in completed:
            rx.on_layer_received(record.transfer_id, layer)
    return status


def _write(rx: KVReceiver, header: PartHeader, payload: torch.Tensor, record: Incoming,
           channel_id: int) -> tuple[Status, list[int]]:
    """Write a verified part into the blocks: its status, and the layers it completed."""
    key = (header.layer_start, header.layer_end, header.row_start, header.row_end,
           header.head_start, header.head_end)
    lay = rx.layout
    with record.lock:
        status = _settled_status(rx, record)
        if status is not None:
            return status, []
        if key in record.seen:
            rx.stats.duplicate_parts += 1
            return Status.OK, []
        heads = local_heads(lay.num_kv_heads, rx.tp_rank, rx.tp_size, header.head_start,
                            header.head_end)
        rows = (header.row_start, header.row_end)
        src = rows_view(payload, record.kv_cache.dtype, rows[1] - rows[0], lay.block_size,
                        header.head_end - header.head_start, lay.head_dim)
        scatter(record.kv_cache, record.block_ids, heads, header.layer_start, record.num_blocks,
                rows, src)
        record.seen.add(key)
        record.channels.add(channel_id)
        completed = []
        for seg in segments(header.layer_start, record.num_blocks, *rows):
            before = record.units[seg.layer]
            record.units[seg.layer] += (seg.block_end - seg.block_start) * (
                header.head_end - header.head_start)
            if before < record.units_per_layer <= record.units[seg.layer]:
                completed.append(seg.layer)
        _settle_if_complete(record)
    return Status.OK, completed


def _keep_trailer(rx: KVReceiver, header: PartHeader, record: Incoming, channel_id: int
                  ) -> Status:
    with record.lock:
        status = _settled_status(rx, record)
        if status is not None:
            return status
        if record.trailer is not None:
            rx.stats.duplicate_parts += 1
            return Status.OK
        record.trailer = header.trailer
        record.channels.add(channel_id)
        _settle_if_complete(record)
    return Status.OK


def _settled_status(rx: KVReceiver, record: Incoming) -> Status | None:
    """The status for a part of a transfer that ended (lock held; a transfer past its
    deadline fails here), or None while it is active."""
    from kvtransfer.receiver import State

    if record.state == State.ACTIVE and time.monotonic() > record.deadline:
        record.state = State.FAILED
        record.error = TransferTimeout("KV incomplete at the deadline", record.transfer_id)
        return Status.NOT_EXPECTED
    if record.state == State.ACTIVE:
        return None
    rx.stats.late_parts += 1
    return Status.DONE_BEFORE if record.state == State.DONE else Status.NOT_EXPECTED


def _settle_if_complete(record: Incoming) -> None:
    """Every layer (and the trailer, when wanted) is in: the transfer is done (lock held)."""
    from kvtransfer.receiver import State

    if all(u >= record.units_per_layer for u in record.units) and (
            record.trailer is not None or not record.wants_trailer):
        record.state = State.DONE


def _check_trailer(rx: KVReceiver, header: PartHeader, record: Incoming) -> str | None:
    """Why trailer ``header`` cannot belong to ``record`` on this rank (None when it can)."""
    mismatch = header.check_layout(rx.layout)
    if mismatch is not None:
        return f"KV layout differs: {mismatch}"
    if not record.wants_trailer:
        return f"a trailer for transfer {record.transfer_id}, which has none on rank {rx.tp_rank}"
    if header.num_tokens != record.num_tokens or header.payload_nbytes:
        return f"trailer of {header.num_tokens} tokens with {header.payload_nbytes} payload bytes"
    if header.first_token_id < 0 or not 0 <= header.num_cached_tokens <= record.num_tokens:
        return f"trailer {header.trailer} out of range"
    return None


def _check_part(rx: KVReceiver, header: PartHeader, record: Incoming) -> str | None:
    """Why ``header`` cannot belong to ``record`` on this rank (None when it can)."""
    lay = rx.layout
    mismatch = header.check_layout(lay)
    if mismatch is not None:
        return f"KV layout differs: {mismatch}"
    if header.num_tokens != record.num_tokens:
        return f"num_tokens {header.num_tokens} != expected {record.num_tokens}"
    if not 0 <= header.layer_start < header.layer_end <= lay.num_layers:
        return f"layers [{header.layer_start}, {header.layer_end})"
    try:
        local_heads(lay.num_kv_heads, rx.tp_rank, rx.tp_size, header.head_start, header.head_end)
    except ValueError as exc:
        return str(exc)
    num_rows = (header.layer_end - header.layer_start) * 2 * record.num_blocks
    if not 0 <= header.row_start < header.row_end <= num_rows:
        return f"rows [{header.row_start}, {header.row_end}) of {num_rows}"
    row_bytes = lay.block_size * (header.head_end - header.head_start) * lay.head_dim * lay.element_size
    nbytes = (header.row_end - header.row_start) * row_bytes
    if not header.flags & Flag.CANCELLED and header.payload_nbytes != nbytes:
        return f"payload of {header.payload_nbytes} bytes, expected {nbytes}"
    return None
