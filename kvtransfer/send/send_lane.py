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
any failure in between closes the channel instead. The lane owns its queue of jobs (under
its own lock); it knows its sender only through a ``LaneContext`` and reports each job's
end to the job's transfer (``kvtransfer.send.outgoing``). A message whose receiver stays
silent for a whole timeout (or cannot be reached) fails, and so do the jobs that have
waited behind it for half a timeout or more, at once, rather than each after a timeout of
its own; a job queued more recently tries the receiver again (a stalled decode worker may
have resumed meanwhile).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.kvcache.layout import KVLayout
from engine.tp.distributed import StoreAddress
from kvtransfer.config import TransferConfig
from kvtransfer.errors import (
    ChannelClosed,
    ChannelError,
    ChecksumMismatch,
    LayoutMismatch,
    PeerUnresponsive,
    TransferError,
    TransferRejected,
)
from kvtransfer.plan import local_heads
from kvtransfer.send.open_route import open_route
from kvtransfer.send.outgoing import Job, Outgoing
from kvtransfer.stats import SenderStats
from kvtransfer.transport.buffers import BufferPool
from kvtransfer.transport.channel import Channel, Pending
from kvtransfer.transport.pool import ChannelPool
from kvtransfer.wire.checksum import algo_for, checksum
from kvtransfer.wire.packing import gather_for_wire, split_rows
from kvtransfer.wire.protocol import HEADER_BYTES, Ack, Flag, OpenRequest, PartHeader, Status

log = logging.getLogger(__name__)
SEND_DEPTH = 3  # parts of a message in flight at once (each with its own buffer)

FaultHook = Callable[[PartHeader, torch.Tensor], None]
"""Test hook: called with each part's header and payload after the checksum, before
sending (it may flip a byte, stop or kill the process, or abort the transfer)."""


@dataclass(frozen=True)
class LaneKey:
    dest: StoreAddress
    receiver_rank: int


@dataclass(frozen=True)
class LaneContext:
    """What a lane needs of its sender: who sends (layout, rank, name), with what
    (settings, the channel pool, staging buffers), where to count, the test fault hook,
    and how to make the sender re-read a destination's layout after a broken channel."""

    layout: KVLayout
    tp_rank: int
    tp_size: int
    name: str
    config: TransferConfig
    pool: ChannelPool
    buffers: BufferPool
    stats: SenderStats
    fault_hook: FaultHook | None
    forget_peer: Callable[[StoreAddress], None]


def retire_idle_lanes(lanes: dict[LaneKey, SendLane], peers: dict[StoreAddress, Any],
                      idle_timeout_s: float) -> None:
    """Forget the ``lanes`` idle for ``idle_timeout_s`` (``SendLane.retire_if_idle``), and
    the ``peers`` entry of a destination none of whose lanes is left: a decode worker that
    went away leaves no connection or record behind (the sender's lock held)."""
    for key in [k for k, lane in lanes.items() if lane.retire_if_idle(idle_timeout_s)]:
        del lanes[key]
        if not any(k.dest == key.dest for k in lanes):
            peers.pop(key.dest, None)


class SendLane:
    """Jobs of one route; its thread runs while there are any (see module doc)."""

    def __init__(self, ctx: LaneContext, key: LaneKey, backend: str) -> None:
        self.ctx = ctx
        self.key = key
        self.backend = backend
        self._lock = threading.Lock()
        self._jobs: deque[tuple[float, Job]] = deque()  # (when queued, job)
        self._thread: threading.Thread | None = None
        self._store: Any = None  # client of the receiver's store, kept across channel opens
        self._idle_since = time.monotonic()  # when its thread last ran out of jobs

    @property
    def thread(self) -> threading.Thread | None:
        with self._lock:
            return self._thread

    def submit(self, job: Job) -> None:
        """Queue ``job`` behind the lane's others; start the thread if it has none."""
        with self._lock:
            self._jobs.append((time.monotonic(), job))
            if self._thread is None:
                name = f"kvtransfer-send-{self.key.dest.port}/{self.key.receiver_rank}"
                self._thread = threading.Thread(target=self._main, name=name, daemon=True)
                self._thread.start()

    def drop_store(self) -> None:
        """Forget the rendezvous connection (the sender is closing)."""
        self._store = None

    def retire_if_idle(self, idle_timeout_s: float) -> bool:
        """True (its rendezvous connection dropped) when the lane has had no job and no
        thread for ``idle_timeout_s``: a destination nothing was sent to for that long may
        be a decode worker that is gone, and the lane's connection to its store an open
        socket held for nothing. The sender then forgets the lane (and submits nothing
        more to it); a later transfer to that address makes a new one."""
        with self._lock:
            if self._thread is not None or self._jobs \
                    or time.monotonic() - self._idle_since <= idle_timeout_s:
                return False
            self._store = None
            return True

    def _next_job(self) -> Job | None:
        """The next job; None (and the lane has no thread any more) when there is none."""
        with self._lock:
            if self._jobs:
                return self._jobs.popleft()[1]
            self._thread = None
            self._idle_since = time.monotonic()
            return None

    def _main(self) -> None:
        while (job := self._next_job()) is not None:
            try:
                self._run(job)
            except TransferError as exc:
                job.record.fail(exc)
                if isinstance(exc, PeerUnresponsive):
                    _fail_behind(self._take_waiting(self.ctx.config.timeout_s / 2), exc)
            except Exception as exc:  # a bug must fail the transfer, not kill the lane
                log.exception("send lane %s failed", self.key)
                job.record.fail(TransferError(f"sender error: {exc!r}", job.record.transfer_id))
            finally:
                job.record.job_done()

    def _take_waiting(self, min_wait_s: float) -> list[Job]:
        """Remove and return the queued jobs that have waited ``min_wait_s`` or longer."""
        queued_before, taken = time.monotonic() - min_wait_s, []
        with self._lock:
            while self._jobs and self._jobs[0][0] <= queued_before:
                taken.append(self._jobs.popleft()[1])
        return taken

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
                self.ctx.pool.discard(channel, str(exc))
                if reused and attempt == 0 and record.error is None:  # not for a failed one
                    self.ctx.stats.retries += 1
                    continue
                self.ctx.forget_peer(record.dest)
                raise ChannelClosed(str(exc), record.transfer_id) from exc
            except ChannelError as exc:
                self.ctx.pool.discard(channel, str(exc))
                self.ctx.forget_peer(record.dest)
                raise type(exc)(str(exc), record.transfer_id) from exc
            except BaseException:
                self.ctx.pool.discard(channel, "sender error mid-message")
                raise
            self.ctx.pool.checkin(channel)
            _raise_for(ack, record.transfer_id)
            return

    def _acquire(self, record: Outgoing) -> tuple[Channel, bool]:
        """The route's open channel (reused = True), else a newly opened one."""
        pool, cfg = self.ctx.pool, self.ctx.config
        pool.sweep_idle()
        channel = pool.checkout(self.key)
        if channel is not None:
            return channel, True
        pool.reserve(cfg.timeout_s)
        c = self.ctx
        request = OpenRequest(0, c.name, c.tp_rank, c.tp_size, self.key.receiver_rank,
                              self.backend, c.layout)
        try:
            self._store, channel, reply = open_route(self._store, self.key.dest, request,
                                                      record.kv_cache.device, cfg)
        except BaseException as exc:
            pool.cancel()
            if not isinstance(exc, LayoutMismatch):
                self._store = None  # reconnect next time: the receiver may have restarted
            if isinstance(exc, RuntimeError) and not isinstance(exc, TransferError):
                dest = self.key.dest
                raise PeerUnresponsive(f"decode worker at {dest.host}:{dest.port} unreachable: "
                                       f"{str(exc).splitlines()[0][:200]}") from exc
            raise
        if reply.receiver_tp_size != record.receiver_tp:
            channel.close("receiver TP size changed")
            pool.cancel()
            self.ctx.forget_peer(record.dest)
            raise TransferError(f"decode worker's TP size changed ({record.receiver_tp} -> "
                                f"{reply.receiver_tp_size})", record.transfer_id)
        channel.max_part_bytes = reply.max_part_bytes
        pool.add(self.key, channel)
        self.ctx.stats.channels_opened += 1
        return channel, False

    def _send_message(self, channel: Channel, job: Job) -> Ack:
        """Send one message's parts, ``SEND_DEPTH`` in flight, and await its acknowledgement."""
        record, route, c = job.record, job.route, self.ctx
        lay = c.layout
        heads = local_heads(lay.num_kv_heads, c.tp_rank, c.tp_size, route.head_start, route.head_end)
        row_bytes = lay.row_bytes(route.num_heads)
        part_bytes = min(c.config.part_bytes, channel.max_part_bytes)
        if row_bytes > part_bytes:
            raise TransferError(f"one block ({row_bytes} bytes per layer) exceeds the part size "
                                f"({part_bytes} bytes)", record.transfer_id)
        num_rows = (job.layer_end - job.layer_start) * 2 * record.num_blocks
        parts = split_rows(num_rows, row_bytes, part_bytes)
        first_seq = channel.alloc_seqs(len(parts))  # from here on, every part must be sent
        size = HEADER_BYTES + part_bytes - part_bytes % row_bytes
        buffers = [c.buffers.take(size, record.kv_cache.device)
                   for _ in range(min(SEND_DEPTH, len(parts)))]
        inflight: deque[list[Pending]] = deque()
        timeout = c.config.timeout_s
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
                    c.buffers.give(buffer)
        c.stats.parts_sent += len(parts)
        c.stats.bytes_sent += num_rows * row_bytes
        return self._matching_ack(channel, ack_op, record.transfer_id,
                                  first_seq + len(parts) - 1)

    def _send_trailer(self, channel: Channel, job: Job) -> Ack:
        """Send the transfer's trailer (a header-only part; marked cancelled when the
        transfer failed meanwhile) and await its acknowledgement."""
        record, c = job.record, self.ctx
        assert job.trailer is not None
        seq = channel.alloc_seqs(1)  # from here on, the part must be sent
        flags = Flag.LAST_PART | (Flag.CANCELLED if record.error is not None else Flag.NONE)
        header = PartHeader.trailer_part(
            layout=c.layout, seq=seq, transfer_id=record.transfer_id,
            num_tokens=record.num_tokens, trailer=job.trailer, sender_rank=c.tp_rank,
            sender_tp_size=c.tp_size, flags=int(flags))
        ops = channel.send_part(header, torch.empty(HEADER_BYTES, dtype=torch.uint8))
        ack_op = channel.recv_ack(seq)
        for op in [*ops, ack_op]:
            channel.wait(op, c.config.timeout_s)
        c.stats.parts_sent += 1
        return self._matching_ack(channel, ack_op, record.transfer_id, seq)

    def _prepare_part(self, job: Job, heads: tuple[int, int], rows: tuple[int, int],
                      buffer: torch.Tensor, seq: int, *, last: bool) -> PartHeader:
        """Gather the part's rows into ``buffer`` after its header room (unless the
        transfer failed meanwhile: then the part is marked cancelled) and build its header."""
        record, route, c = job.record, job.route, self.ctx
        lay = c.layout
        row_bytes = lay.row_bytes(route.num_heads)
        payload = buffer[HEADER_BYTES : HEADER_BYTES + (rows[1] - rows[0]) * row_bytes]
        algo = algo_for(payload.device)
        flags = Flag.LAST_PART if last else Flag.NONE
        with record.lock:  # the blocks are read only while the transfer is live
            cancelled = record.error is not None
            if not cancelled:
                gather_for_wire(record.kv_cache, record.block_ids, heads, job.layer_start,
                                record.num_blocks, rows, payload, lay)
                if payload.is_cuda:
                    torch.cuda.current_stream(payload.device).synchronize()
        header = PartHeader.data(
            layout=lay, seq=seq, transfer_id=record.transfer_id, num_tokens=record.num_tokens,
            layers=(job.layer_start, job.layer_end), heads=(route.head_start, route.head_end),
            rows=rows, payload_nbytes=0 if cancelled else payload.numel(),
            checksum_algo=int(algo), checksum=0 if cancelled else checksum(payload, algo),
            sender_rank=c.tp_rank, sender_tp_size=c.tp_size,
            flags=int(flags | Flag.CANCELLED) if cancelled else int(flags))
        if c.fault_hook is not None and not cancelled:
            c.fault_hook(header, payload)
        return header


    def _matching_ack(self, channel: Channel, op: Pending, transfer_id: int, seq: int) -> Ack:
        """The acknowledgement of part ``seq`` of ``transfer_id`` (``op`` has completed).

        An acknowledgement that is malformed or names another transfer or part (a
        duplicate, a late one, a peer's bug) is counted (``unexpected_acks``), logged and
        ignored: another receive is posted and the lane keeps waiting, up to the transfer
        timeout from the first unexpected one. It never closes the channel or fails the
        transfer by itself; only a wait that runs out does (``ChannelError``).
        """
        deadline: float | None = None
        while True:
            ack = _decode_ack(op, channel)
            if ack is not None and (ack.transfer_id, ack.seq) == (transfer_id, seq):
                return ack
            self.ctx.stats.unexpected_acks += 1
            what = "malformed" if ack is None else f"for {ack.transfer_id}/{ack.seq}"
            log.warning("send lane %s: ignoring an unexpected acknowledgement (%s) while "
                        "waiting for %d/%d", self.key, what, transfer_id, seq)
            now = time.monotonic()
            deadline = now + self.ctx.config.timeout_s if deadline is None else deadline
            op = channel.recv_ack(seq)
            channel.wait(op, max(0.001, deadline - now))


def _fail_behind(queued: list[Job], cause: PeerUnresponsive) -> None:
    """Fail the jobs that waited behind one whose receiver stayed silent for a whole
    timeout (or could not be reached): each would wait out a timeout of its own on the
    same receiver, the last of k queued ones k timeouts late. Jobs queued later (and
    those submitted after this) try the receiver again: a receiver that was only stalled
    (paused, swapping) serves them, a dead one fails them within one more timeout."""
    for job in queued:
        job.record.fail(PeerUnresponsive(f"not sent: an earlier message on this route "
                                         f"failed ({cause})", job.record.transfer_id))
        job.record.job_done()


def _decode_ack(op: Pending, channel: Channel) -> Ack | None:
    """The acknowledgement received, None if malformed or without the channel's MAC."""
    try:
        ack = Ack.decode(op.tensor.tolist())
    except ValueError:
        return None
    return ack if channel.check_ack(ack) else None


def _raise_for(ack: Ack, transfer_id: int) -> None:
    """Map the receiver's verdict on a message to an error (none for OK / DONE_BEFORE)."""
    if ack.status in (Status.OK, Status.DONE_BEFORE):
        return
    if ack.status == Status.CHECKSUM_MISMATCH:
        raise ChecksumMismatch("the receiver found a corrupted payload", transfer_id)
    raise TransferRejected(f"the receiver refused the message ({ack.status.name})", transfer_id)
