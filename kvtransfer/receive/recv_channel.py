"""The receiving end of one channel: one thread, and a ring of receives posted ahead.

The channel knows its receiver only through ``PartSink`` (resolve a part to its transfer,
deliver it, fail a transfer, report the channel's end); each transfer's state machine is
``kvtransfer.receive.incoming``.

The thread takes the parts in order (0, 1, ...). Each arrives whole (header and payload
in one message, or on nccl the payload right after) into one of the ``RECV_DEPTH``
buffers the ring keeps posted, so the sender never waits for a "ready to receive"
round trip. Between messages the wait is up to ``idle_timeout_s`` (the channel then
closes itself), within a message up to ``timeout_s``. Each part is resolved to its
transfer, verified (its MAC on an authenticated channel: a part that fails it fails its
transfer and closes the channel), written into the transfer's blocks, and each message's
last part acknowledged; then its buffer is posted again for a later part.

Ownership: the channel belongs to the receiver's pool and counts as borrowed (never
closed to make room) from a message's first part to its last. The ring's buffers
belong to this thread; blocks are written only under the transfer's lock while it is
active (see ``KVReceiver``).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import torch

from kvtransfer.config import TransferConfig
from kvtransfer.errors import ChannelError, TransferError
from kvtransfer.receive.incoming import Incoming
from kvtransfer.stats import ReceiverStats
from kvtransfer.transport.channel import Channel, Pending
from kvtransfer.transport.pool import ChannelPool
from kvtransfer.wire.protocol import HEADER_BYTES, Ack, Kind, PartHeader, Status

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


class PartSink(Protocol):
    """What a channel needs of its receiver (``kvtransfer.receive.receiver.KVReceiver``)."""

    config: TransferConfig
    stats: ReceiverStats
    pool: ChannelPool
    device: torch.device

    def resolve(self, header: PartHeader) -> Incoming | Status:
        """The transfer a part belongs to, or the status to acknowledge it with."""
        ...

    def deliver(self, header: PartHeader, payload: torch.Tensor, record: Incoming,
                channel_id: int) -> Status:
        """Verify and write one part of ``record``; the status to acknowledge it with."""
        ...

    def fail(self, record: Incoming, error: TransferError) -> None: ...

    def channel_closed(self, channel_id: int, reason: str | None) -> None:
        """The channel ended: on purpose (``reason`` None) or broken."""
        ...


class RecvChannel:
    """The thread and state of one accepted channel (see module doc)."""

    def __init__(self, receiver: PartSink, channel_id: int, channel: Channel) -> None:
        self.receiver = receiver
        self.channel_id = channel_id
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
            rx.channel_closed(self.channel_id, reason)

    def _loop(self, ring: RecvRing) -> str | None:
        """Handle parts until the channel ends: None when it was closed on purpose."""
        rx, cfg = self.receiver, self.receiver.config
        seq, mid_message, message_status = 0, False, Status.OK
        while True:
            # the first message follows the opening at once (the channel is borrowed for
            # it meanwhile: the acceptor's); later ones may wait for work, idle
            header, buffer = ring.wait(seq, cfg.timeout_s if mid_message or seq == 0
                                       else cfg.idle_timeout_s)
            if seq == 0:
                self.channel.forget_rendezvous()
            if header.kind == Kind.CLOSE:
                if not self.channel.check_part(header, buffer):
                    raise ValueError(f"part {seq} (a close) failed its MAC")
                self._acknowledge(header, Status.OK)
                return None
            if not mid_message and seq and rx.pool.checkout(self.channel_id) is None:
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
        if not self.channel.check_part(header, payload):  # injected, or not this channel's
            if not isinstance(target, Status):
                rx.fail(target, TransferError("a KV part failed its MAC", header.transfer_id))
            raise ValueError(f"part {header.seq} failed its MAC")
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
