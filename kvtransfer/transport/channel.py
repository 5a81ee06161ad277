"""Transport: a channel is one two-rank group, sender rank 0 and receiver rank 1.

Channels are opened on demand through the receiving worker's rendezvous store (a
``TCPStore`` it advertises as host:port), with no global world: the sender pushes an
``OpenRequest`` into the receiver rank's accept queue, the receiver checks the KV layout
and replies, then both build the group with ``engine.tp.distributed.make_group`` under a
prefix no other channel uses (channel ids come from a counter in the store).

Headers and acknowledgements travel on a gloo group (CPU); payloads on a second group
whose backend follows the KV device (``nccl`` for CUDA), or on the same gloo group for
CPU tensors. Tags follow ``kvtransfer.wire.protocol``. With ``TransferConfig.auth_keys``
the opening is a mutual proof of the cluster token and every part and acknowledgement
carries a MAC under the channel's own key (``kvtransfer.wire.auth``; ``Channel.mac``).

Ownership: a channel belongs to the ``ChannelPool`` of the sender or receiver that
opened or accepted it. Any failed or timed-out wait closes the channel for good
(``Group.abort``: both sides' pending operations fail at once); it is never reused.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.kvcache.layout import KVLayout
from engine.tp.distributed import Group, StoreAddress, backend_for, make_group
from kvtransfer.config import TransferConfig
from kvtransfer.errors import ChannelClosed, ChannelError, LayoutMismatch, PeerUnresponsive
from kvtransfer.wire import auth
from kvtransfer.wire.protocol import (
    HEADER_BYTES,
    MAX_SEQ,
    Ack,
    OpenReply,
    OpenRequest,
    OpenStatus,
    PartHeader,
    ReceiverInfo,
)

SENDER, RECEIVER = 0, 1
KEY_RECEIVER_INFO = "kvtransfer/worker"
KEY_NEXT_CHANNEL = "kvtransfer/next_channel"


def accept_key(receiver_rank: int) -> str:
    return f"kvtransfer/accept/{receiver_rank}"


def reply_key(channel_id: int) -> str:
    return f"kvtransfer/reply/{channel_id}"


def abandoned_key(channel_id: int) -> str:
    """Set by a sender that gave up waiting for its open request's answer."""
    return f"kvtransfer/abandoned/{channel_id}"


def proof_key(channel_id: int) -> str:
    return f"kvtransfer/proof/{channel_id}"


def group_prefix(channel_id: int) -> str:
    return f"kvtransfer/ch/{channel_id}"


@dataclass
class Pending:
    """An operation in flight; ``tensor`` stays referenced until it completes."""

    work: Any
    tensor: torch.Tensor
    what: str
    nccl: bool = False


class Channel:
    """One open pairwise group. Thread-safe: several threads may post and wait."""

    def __init__(self, channel_id: int, role: int, control: Group, data: Group, store: Any
                 ) -> None:
        self.channel_id = channel_id
        self.role = role
        self.peer = 1 - role
        self._control = control
        self._data = data
        self._store = store  # keeps the rendezvous connection while the groups live
        self._lock = threading.Lock()
        self._next_seq = 0
        self.closed_reason: str | None = None
        self.closed_by_error = False  # an operation failed (vs closed here on purpose)
        self.max_part_bytes = 0  # the receiver's largest part (sender side, from OpenReply)
        self.last_used = time.monotonic()
        self.mac: auth.ChannelMac | None = None  # set once the handshake authenticated it

    @property
    def is_open(self) -> bool:
        return self.closed_reason is None

    def alloc_seqs(self, count: int) -> int:
        """Reserve ``count`` consecutive part numbers (sender); every one must then be sent."""
        with self._lock:
            first = self._next_seq
            if first + count > MAX_SEQ:
                raise ChannelClosed(f"channel {self.channel_id}: tags exhausted")
            self._next_seq += count
            return first

    @property
    def split_payload(self) -> bool:
        """True when payloads travel on their own (nccl) group, apart from headers."""
        return self._data is not self._control

    def send_part(self, header: PartHeader, buffer: torch.Tensor) -> list[Pending]:
        """Send part ``header.seq``: ``buffer`` holds the payload at ``[HEADER_BYTES:]``
        (``header.payload_nbytes`` of it); the header is written in front of it.
        ``buffer`` must not change until the returned operations complete."""
        end = HEADER_BYTES + header.payload_nbytes
        if self.mac is not None:
            covered = (None if self.split_payload or not header.payload_nbytes
                       else buffer[HEADER_BYTES:end].numpy().data)
            header = header.with_mac(self.mac.words_mac(b"part", header.seq,
                                                        header.mac_words(), covered))
        words = torch.tensor(header.encode(), dtype=torch.int64)
        if not self.split_payload:
            buffer[: 8 * len(words)].view(torch.int64).copy_(words)
            return [Pending(self._post(self._control.isend, buffer[:end], header.seq),
                            buffer, f"part {header.seq}")]
        ops = [Pending(self._post(self._control.isend, words, header.seq), words,
                       f"header {header.seq}")]
        if header.payload_nbytes:
            payload = buffer[HEADER_BYTES:end]
            ops.append(Pending(self._post(self._data.isend, payload, header.seq), payload,
                               f"payload {header.seq}", nccl=True))
        return ops

    def recv_part(self, seq: int, buffer: torch.Tensor) -> Pending:
        """Post the receive of part ``seq`` into ``buffer`` (CPU, ``HEADER_BYTES`` +
        max part bytes; only ``HEADER_BYTES`` when payloads are split off)."""
        return Pending(self._post(self._control.irecv, buffer, seq), buffer, f"part {seq}")

    def recv_payload(self, payload: torch.Tensor, seq: int) -> Pending:
        """Split payloads only: receive part ``seq``'s payload (exactly its size)."""
        return Pending(self._post(self._data.irecv, payload, seq), payload,
                       f"payload {seq}", nccl=True)

    def check_part(self, header: PartHeader, payload: torch.Tensor) -> bool:
        """Whether a received part carries this channel's MAC (always, unauthenticated).
        ``payload``: its bytes (CPU; a split payload's device bytes are not covered)."""
        if self.mac is None:
            return True
        data = None if self.split_payload or not header.payload_nbytes else payload.numpy().data
        return self.mac.check(b"part", header.seq, header.mac_words(), header.mac, data)

    def check_ack(self, ack: Ack) -> bool:
        """Whether an acknowledgement carries this channel's MAC (always, unauthenticated)."""
        return self.mac is None or self.mac.check(b"ack", ack.seq, ack.mac_words(), ack.mac)

    def send_ack(self, ack: Ack) -> Pending:
        if self.mac is not None:
            ack = ack.with_mac(self.mac.words_mac(b"ack", ack.seq, ack.mac_words()))
        words = torch.tensor(ack.encode(), dtype=torch.int64)
        return Pending(self._post(self._control.isend, words, ack.seq), words, "ack")

    def recv_ack(self, seq: int) -> Pending:
        words = torch.empty(Ack.WORDS, dtype=torch.int64)
        return Pending(self._post(self._control.irecv, words, seq), words, f"ack {seq}")

    def _post(self, start: Any, tensor: torch.Tensor, tag: int) -> Any:
        """Start an operation; a broken connection shows up here too (as ``ChannelClosed``)."""
        if not self.is_open:
            raise ChannelClosed(f"channel {self.channel_id} closed: {self.closed_reason}")
        try:
            return start(tensor, self.peer, tag)
        except (RuntimeError, AssertionError) as exc:
            reason = str(exc).splitlines()[0][:300]
            self.closed_by_error = True
            self.close(reason)
            raise ChannelClosed(f"channel {self.channel_id}: {reason}") from exc

    def wait(self, op: Pending, timeout_s: float) -> None:
        """Block until ``op`` completes; ``ChannelError`` (and the channel closed) if it
        fails or takes longer than ``timeout_s``."""
        if not self.is_open:
            raise ChannelClosed(f"channel {self.channel_id} closed: {self.closed_reason}")
        try:
            if op.nccl:
                _wait_polling(op.work, timeout_s)
            else:
                op.work.wait(datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, TimeoutError) as exc:
            reason = f"{op.what}: {exc}".splitlines()[0][:300]
            closed_here = self.closed_reason is not None
            if not closed_here:
                self.closed_by_error = True
                self.close(reason)
            timed_out = "timed out" in str(exc).lower() and not closed_here
            cls = PeerUnresponsive if timed_out else ChannelClosed
            raise cls(f"channel {self.channel_id}: {self.closed_reason}") from exc
        self.last_used = time.monotonic()

    def forget_rendezvous(self) -> None:
        """Delete the group's rendezvous keys (call once both sides exchanged a message)."""
        prefix = group_prefix(self.channel_id)
        for key in (f"{prefix}/0/0", f"{prefix}/0/1", f"{prefix}/data/0/0", f"{prefix}/data/0/1"):
            try:
                self._store.delete_key(key)
            except RuntimeError:
                return

    def close(self, reason: str = "closed", *, graceful: bool = False) -> None:
        """Cut the connections (the peer notices at once) and drop the groups. Idempotent.

        ``graceful`` (sender side, idle channel only): first tell the receiver, so it
        knows no transfer was cut off (``Kind.CLOSE``, acknowledged; at most 1 s)."""
        if graceful and self.role == SENDER and self.is_open:
            self._say_goodbye()
        with self._lock:
            if self.closed_reason is not None:
                return
            self.closed_reason = reason
        if self._data is not self._control:
            self._data.abort()
        self._control.abort()


    def _say_goodbye(self) -> None:
        """Send ``Kind.CLOSE`` and wait (at most 1 s) for its acknowledgement."""
        try:
            seq = self.alloc_seqs(1)
            ops = self.send_part(PartHeader.closing(seq), torch.empty(HEADER_BYTES, dtype=torch.uint8))
            for op in [*ops, self.recv_ack(seq)]:
                op.work.wait(datetime.timedelta(seconds=1.0))
        except RuntimeError:
            pass  # the peer is gone or hung (then the channel is closed already): cut anyway


def _wait_polling(work: Any, timeout_s: float) -> None:
    """NCCL: wait on the CPU without blocking forever (``is_completed`` queries events)."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.1f}s")
        time.sleep(0.0002)
    work.wait()


# ---------------------------------------------------------------- handshake


def advertise(store: Any, info: ReceiverInfo) -> None:
    """Publish the decode worker's layout and TP size in its rendezvous store."""
    store.set(KEY_RECEIVER_INFO, info.encode())


def read_receiver_info(store: Any, timeout_s: float) -> ReceiverInfo:
    store.wait([KEY_RECEIVER_INFO], datetime.timedelta(seconds=timeout_s))
    return ReceiverInfo.decode(store.get(KEY_RECEIVER_INFO))


def open_channel(store: Any, address: StoreAddress, request: OpenRequest, device: torch.device,
                 config: TransferConfig) -> tuple[Channel, OpenReply]:
    """Sender side: ask receiver rank ``request.receiver_rank`` for a channel and join it.

    ``store`` is a client of the receiver's rendezvous store at ``address`` (reused
    across opens: every new store connection costs a reverse DNS lookup on both ends).
    ``request.channel_id`` is replaced by a fresh one from the store. Returns the channel
    and the receiver's reply (its TP size and largest part). Raises ``LayoutMismatch`` when refused, ``ChannelError``
    when the receiver does not answer (or stays busy) within ``config.timeout_s``.
    """
    deadline = time.monotonic() + config.timeout_s
    keys = config.auth_keys
    try:
        while True:
            channel_id = int(store.add(KEY_NEXT_CHANNEL, 1))
            req = dataclasses.replace(request, channel_id=channel_id,
                                      nonce=auth.nonce() if keys else "")
            store.queue_push(accept_key(request.receiver_rank), req.encode())
            remaining = max(0.001, deadline - time.monotonic())
            try:
                store.wait([reply_key(channel_id)], datetime.timedelta(seconds=remaining))
            except RuntimeError:
                _abandon(store, channel_id)
                raise
            reply = OpenReply.decode(store.get(reply_key(channel_id)))
            store.delete_key(reply_key(channel_id))
            if reply.status != OpenStatus.BUSY:
                break
            if time.monotonic() > deadline:
                raise ChannelError(f"receiver rank {request.receiver_rank} at {address} stays busy")
            time.sleep(0.02)
    except RuntimeError as exc:
        if isinstance(exc, ChannelError):
            raise
        raise PeerUnresponsive(f"no channel to {address.host}:{address.port} rank "
                           f"{request.receiver_rank}: {str(exc).splitlines()[0][:200]}") from exc
    if reply.status == OpenStatus.LAYOUT_MISMATCH:
        raise LayoutMismatch(f"receiver refused the channel: {reply.reason}")
    if reply.status == OpenStatus.UNAUTHENTICATED:
        raise ChannelError(f"the receiver at {address.host}:{address.port} refused the channel: "
                           f"{reply.reason}")
    mac = None
    if keys:
        try:
            key, index = auth.sender_key(keys, reply.proofs.split(","), channel_id,
                                         req.nonce, reply.nonce)
        except auth.AuthError as exc:  # an impostor, or another cluster: send it nothing
            raise ChannelError(f"channel to {address.host}:{address.port}: {exc}") from None
        store.set(proof_key(channel_id), auth.sender_proof(key, channel_id, req.nonce,
                                                           reply.nonce, index))
        mac = auth.ChannelMac(auth.channel_key(key, channel_id, req.nonce, reply.nonce))
    channel = join_channel(store, channel_id, SENDER, device, config)
    channel.mac = mac
    return channel, reply


def _abandon(store: Any, channel_id: int) -> None:
    """No answer in time: tell the receiver to drop the open request if it has not taken
    it yet (else it would answer it later, holding a channel slot for a sender that left,
    and leave the reply's key in its store); an answer that came meanwhile is deleted.
    A receiver between its check of the mark and its answer still answers (its reply's
    key stays, and an accepted channel's slot is held until its join times out)."""
    try:
        store.set(abandoned_key(channel_id), b"")
        if store.check([reply_key(channel_id)]):  # taken before the mark: not read there
            store.delete_key(reply_key(channel_id))
            store.delete_key(abandoned_key(channel_id))
    except RuntimeError:
        pass  # the store went away: nothing is left in it


def join_channel(store: Any, channel_id: int, role: int, device: torch.device,
                 config: TransferConfig) -> Channel:
    """Both sides: build the channel's groups (blocks until the peer joins, at most
    ``config.timeout_s``)."""
    prefix = group_prefix(channel_id)
    try:
        control = make_group(store, prefix, role, 2, bind_host=config.bind_host,
                             timeout_s=config.timeout_s, threads=1)
        data = control
        if backend_for(device) != "gloo":
            data = make_group(store, f"{prefix}/data", role, 2, device=device,
                              bind_host=config.bind_host, timeout_s=2 * config.timeout_s + 10)
    except RuntimeError as exc:
        raise ChannelError(f"channel {channel_id}: group setup failed: "
                           f"{str(exc).splitlines()[0][:200]}") from exc
    return Channel(channel_id, role, control, data, store)


def layout_refusal(mine: KVLayout, request: OpenRequest, backend: str) -> str | None:
    """Why a receiver must refuse ``request`` (``None`` when it may accept)."""
    diff = mine.diff(request.layout)
    if diff is not None:
        return f"KV layout differs: {diff} (receiver != sender)"
    if backend != request.backend:
        return f"backend: {backend} != {request.backend}"
    return None
