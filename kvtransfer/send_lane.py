"""A send lane: the messages of one route (this prefill rank -> one decode rank), in order.

A lane's thread borrows the route's channel from the sender's pool for one message at
a time, opening a channel when none is open. Per message it reserves consecutive part
numbers and, with ``SEND_DEPTH`` staging buffers, gathers the next parts while earlier
ones are on the wire; then it waits for the receiver's acknowledgement of the last part.
A trailer job is one header-only part, acknowledged like a message; being queued after
the transfer's layers on the same lane, it reaches the receiver after them.

Ownership: while borrowed, the channel is used by this lane's thread only. Once part
numbers are reserved every part is sent (a part of an aborted transfer goes out as a
header marked cancelled, without payload), so the receiver's stream never has a gap;
any failure in between closes the channel instead.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.distributed import StoreAddress, connect_store
from kvtransfer.channel import Channel, Pending, open_channel
from kvtransfer.checksum import algo_for, checksum
from kvtransfer.errors import (
    ChannelClosed,
    ChannelError,
    ChecksumMismatch,
    LayoutMismatch,
    TransferError,
    TransferRejected,
)
from kvtransfer.packing import gather, rows_view, split_rows
from kvtransfer.plan import local_heads
from kvtransfer.protocol import (
    DTYPE_CODES,
    HEADER_BYTES,
    MAGIC,
    Ack,
    Flag,
    Kind,
    OpenRequest,
    PartHeader,
    Status,
)

if TYPE_CHECKING:
    from kvtransfer.sender import Job, KVSender, Outgoing

log = logging.getLogger(__name__)
SEND_DEPTH = 3  # parts of a message in flight at once (each with its own buffer)


@dataclass(frozen=True)
class LaneKey:
    dest: StoreAddress
    receiver_rank: int


class SendLane:
    """Jobs of one route; ``thread`` runs while there are any (see module doc)."""

    def __init__(self, sender: KVSender, key: LaneKey, backend: str) -> None:
        self.sender = sender
        self.key = key
        self.backend = backend
        self.jobs: deque[Job] = deque()
        self.thread: threading.Thread | None = None
        self.store: Any = None  # client of the receiver's store, kept across channel opens

    def start(self) -> None:
        name = f"kvtransfer-send-{self.key.dest.port}/{self.key.receiver_rank}"
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        while (job := self.sender.next_job(self)) is not None:
            try:
                self._run(job)
            except TransferError as exc:
                self.sender.fail(job.record, exc)
            except Exception as exc:  # a bug must fail the transfer, not kill the lane
                log.exception("send lane %s failed", self.key)
                self.sender.fail(job.record, TransferError(f"sender error: {exc!r}",
                                                           job.record.transfer_id))
            finally:
                self.sender.job_done(job.record)

    def _run(self, job: Job) -> None:
        """Send one message; retried once on a fresh channel when a reused idle channel
        turns out closed (the receiver closed it, e.g. to make room)."""
        record = job.record
        if record.error is not None:
            return
        for attempt in range(2):
            channel, reused = self._acquire(record)
            try:
                if job.trailer is not None:
                    ack = self._send_trailer(channel, job)
                else:
                    ack = self._send_message(channel, job)
            except ChannelClosed as exc:
                self.sender.pool.discard(channel, str(exc))
                if reused and attempt == 0:
                    self.sender.stats.retries += 1
                    continue
                self.sender.forget_peer(record.dest)
                raise ChannelClosed(str(exc), record.transfer_id) from exc
            except ChannelError as exc:
                self.sender.pool.discard(channel, str(exc))
                self.sender.forget_peer(record.dest)
                raise ChannelError(str(exc), record.transfer_id) from exc
            except BaseException:
                self.sender.pool.discard(channel, "sender error mid-message")
                raise
            self.sender.pool.checkin(channel)
            _raise_for(ack, record.transfer_id)
            return

    def _acquire(self, record: Outgoing) -> tuple[Channel, bool]:
        """The route's open channel (reused = True), else a newly opened one."""
        pool, cfg = self.sender.pool, self.sender.config
        pool.sweep_idle()
        channel = pool.checkout(self.key)
        if channel is not None:
            return channel, True
        pool.reserve(cfg.timeout_s)
        s = self.sender
        request = OpenRequest(0, s.name, s.tp_rank, s.tp_size, self.key.receiver_rank,
                              self.backend, s.layout)
        try:
            if self.store is None:
                self.store = connect_store(self.key.dest, timeout_s=cfg.timeout_s)
            channel, reply = open_channel(self.store, self.key.dest, request,
                                          record.kv_cache.device, cfg)
        except BaseException as exc:
            pool.cancel()
            if not isinstance(exc, LayoutMismatch):
                self.store = None  # reconnect next time: the receiver may have restarted
            if isinstance(exc, RuntimeError) and not isinstance(exc, TransferError):
                raise ChannelError(f"decode worker at {self.key.dest.host}:{self.key.dest.port}"
                                   f" unreachable: {str(exc).splitlines()[0][:200]}") from exc
            raise
        if reply.receiver_tp_size != record.receiver_tp:
            channel.close("receiver TP size changed")
            pool.cancel()
            self.sender.forget_peer(record.dest)
            raise TransferError(f"decode worker's TP size changed ({record.receiver_tp} -> "
                                f"{reply.receiver_tp_size})", record.transfer_id)
        channel.max_part_bytes = reply.max_part_bytes
        pool.add(self.key, channel)
        self.sender.stats.channels_opened += 1
        return channel, False

    def _send_message(self, channel: Channel, job: Job) -> Ack:
        """Send one message's parts, ``SEND_DEPTH`` in flight, and await its acknowledgement."""
        record, route, s = job.record, job.route, self.sender
        lay = s.layout
        heads = local_heads(lay.num_kv_heads, s.tp_rank, s.tp_size, route.head_start, route.head_end)
        row_bytes = lay.block_size * route.num_heads * lay.head_dim * lay.element_size
        part_bytes = min(s.config.part_bytes, channel.max_part_bytes)
        if row_bytes > part_bytes:
            raise TransferError(f"one block ({row_bytes} bytes per layer) exceeds the part size "
                                f"({part_bytes} bytes)", record.transfer_id)
        num_rows = (job.layer_end - job.layer_start) * 2 * record.num_blocks
        parts = split_rows(num_rows, row_bytes, part_bytes)
        first_seq = channel.alloc_seqs(len(parts))  # from here on, every part must be sent
        size = HEADER_BYTES + part_bytes - part_bytes % row_bytes
        buffers = [s.buffers.take(size, record.kv_cache.device)
                   for _ in range(min(SEND_DEPTH, len(parts)))]
        inflight: deque[list[Pending]] = deque()
        timeout = s.config.timeout_s
        try:
            for k, rows in enumerate(parts):
                if len(inflight) == len(buffers):  # the oldest buffer must be free again
                    for op in inflight.popleft():
                        channel.wait(op, timeout)
                buffer = buffers[k % len(buffers)]
                header = self._prepare_part(job, heads, rows, buffer, first_seq + k,
                                            last=k == len(parts) - 1)
                inflight.append(channel.send_part(header, buffer))
            ack_op = channel.recv_ack(first_seq + len(parts) - 1)
            while inflight:
                for op in inflight.popleft():
                    channel.wait(op, timeout)
            channel.wait(ack_op, timeout)
        finally:
            if channel.is_open:  # else gloo may still hold them: let them be collected
                for buffer in buffers:
                    s.buffers.give(buffer)
        s.stats.parts_sent += len(parts)
        s.stats.bytes_sent += num_rows * row_bytes
        return _check_ack(channel, ack_op, record.transfer_id, first_seq + len(parts) - 1)

    def _send_trailer(self, channel: Channel, job: Job) -> Ack:
        """Send the transfer's trailer (a header-only part; marked cancelled when the
        transfer failed meanwhile) and await its acknowledgement."""
        record, s, lay = job.record, self.sender, self.sender.layout
        assert job.trailer is not None
        seq = channel.alloc_seqs(1)  # from here on, the part must be sent
        flags = Flag.LAST_PART | (Flag.CANCELLED if record.error is not None else Flag.NONE)
        header = PartHeader(
            MAGIC, Kind.TRAILER, seq, record.transfer_id, lay.digest(), lay.num_layers,
            lay.num_kv_heads, lay.head_dim, DTYPE_CODES[lay.dtype], lay.block_size,
            record.num_tokens, 0, 0, 0, 0, 0, 0, 0, 0, 0, s.tp_rank, s.tp_size, int(flags),
            job.trailer.first_token_id, job.trailer.num_cached_tokens)
        ops = channel.send_part(header, torch.empty(HEADER_BYTES, dtype=torch.uint8))
        ack_op = channel.recv_ack(seq)
        for op in [*ops, ack_op]:
            channel.wait(op, s.config.timeout_s)
        s.stats.parts_sent += 1
        return _check_ack(channel, ack_op, record.transfer_id, seq)

    def _prepare_part(self, job: Job, heads: tuple[int, int], rows: tuple[int, int],
                      buffer: torch.Tensor, seq: int, *, last: bool) -> PartHeader:
        """Gather the part's rows into ``buffer`` after its header room (unless the
        transfer failed meanwhile: then the part is marked cancelled) and build its header."""
        record, route, s = job.record, job.route, self.sender
        lay = s.layout
        row_bytes = lay.block_size * route.num_heads * lay.head_dim * lay.element_size
        payload = buffer[HEADER_BYTES : HEADER_BYTES + (rows[1] - rows[0]) * row_bytes]
        algo = algo_for(payload.device)
        flags = Flag.LAST_PART if last else Flag.NONE
        with record.lock:  # the blocks are read only while the transfer is live
            cancelled = record.error is not None
            if not cancelled:
                out = rows_view(payload, record.kv_cache.dtype, rows[1] - rows[0],
                                lay.block_size, route.num_heads, lay.head_dim)
                gather(record.kv_cache, record.block_ids, heads, job.layer_start,
                       record.num_blocks, rows, out)
                if payload.is_cuda:
                    torch.cuda.current_stream(payload.device).synchronize()
        digest = 0 if cancelled else checksum(payload, algo)
        header = PartHeader(
            MAGIC, Kind.DATA, seq, record.transfer_id, lay.digest(), lay.num_layers,
            lay.num_kv_heads, lay.head_dim, DTYPE_CODES[lay.dtype], lay.block_size,
            record.num_tokens, job.layer_start, job.layer_end, route.head_start, route.head_end,
            rows[0], rows[1], 0 if cancelled else payload.numel(), int(algo),
            digest - (1 << 64) if digest >= 1 << 63 else digest, s.tp_rank, s.tp_size,
            int(flags | Flag.CANCELLED) if cancelled else int(flags),
        )
        if s.fault_hook is not None and not cancelled:
            s.fault_hook(header, payload)
        return header


def _check_ack(channel: Channel, op: Pending, transfer_id: int, seq: int) -> Ack:
    try:
        ack = Ack.decode(op.tensor.tolist())
    except ValueError as exc:
        channel.close(f"malformed acknowledgement: {exc}")
        raise ChannelError("malformed acknowledgement", transfer_id) from exc
    if (ack.transfer_id, ack.seq) != (transfer_id, seq):
        channel.close(f"acknowledgement for {ack.transfer_id}/{ack.seq} out of order")
        raise ChannelError("acknowledgement out of order", transfer_id)
    return ack


def _raise_for(ack: Ack, transfer_id: int) -> None:
    """Map the receiver's verdict on a message to an error (none for OK / DONE_BEFORE)."""
    if ack.status in (Status.OK, Status.DONE_BEFORE):
        return
    if ack.status == Status.CHECKSUM_MISMATCH:
        raise ChecksumMismatch("the receiver found a corrupted payload", transfer_id)
    raise TransferRejected(f"the receiver refused the message ({ack.status.name})", transfer_id)
