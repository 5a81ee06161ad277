"""The vocabulary between a worker's leader and the KV plugin on each of its ranks
(``worker.kv.rank``): small typed messages encoded here, never pickled.

Calls (leader → every rank, ``EngineCore.call_ranks(request) -> [reply of rank 0, ...]``,
between steps; none waits on the network):

- ``STATUS(direction, transfer_ids)`` → one ``TransferStatus`` per id: pending, done (a
  received transfer's rank 0: with the ``Trailer`` that arrived) or failed (with the
  reason). A final state is reported once: the rank has then let go of the blocks;
- ``ABORT(direction, transfer_id)`` → b"\\x01" if the rank knew it; returns once the rank
  no longer touches its blocks (idempotent);
- ``STATS`` → ``RankStats`` (both directions' figures);
- ``FINISH(transfer_id, trailer)``: every layer of a sent transfer is queued; rank 0
  queues the trailer (first token, cached-token count) behind them;
- ``EXPECT`` (``Expect``): blocks a received transfer's KV goes into, and its deadlines;
- ``ADDRESS`` → rank 0: its rendezvous store's ``host:port`` (started on this call, once),
  other ranks: empty; ``ATTACH(host:port)``: the other ranks start receiving on it.

Step payload (leader → every rank, with each step): the sends this step starts, as
``SendOrder``s (followers see chunks without request ids, so everything they need is in
here).
"""

from __future__ import annotations

import enum
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from engine.tp.distributed import StoreAddress
from kvtransfer.states import TransferState
from kvtransfer.wire.protocol import Trailer


class Op(enum.IntEnum):
    STATUS = 1
    ABORT = 2
    STATS = 3
    FINISH = 4
    EXPECT = 5
    ADDRESS = 6
    ATTACH = 7


class Direction(enum.IntEnum):
    """Which side of a rank's data plane a call is about."""

    SEND = 1
    RECEIVE = 2

    @property
    def label(self) -> str:
        """The metrics' ``direction`` label."""
        return "sent" if self is Direction.SEND else "received"


# transfer_id, state, has trailer, first token id, cached tokens, len(reason); then reason
_STATUS = struct.Struct("<qBBqqI")
_ID = struct.Struct("<q")
_DIRECTED_ID = struct.Struct("<Bq")
_FINISH = struct.Struct("<Bqqq")  # op, transfer_id, first_token_id, num_cached_tokens
# chunk index, transfer_id, skipped blocks, port, len(host); then host
_ORDER = struct.Struct("<iqiiH")
# op, transfer_id, num_tokens, timeout_s, start_timeout_s; then int64 block ids
_EXPECT = struct.Struct("<Bqqdd")
# per direction (send, receive): pending, open channels, bytes; then max channels,
# checksum failures, unexpected acks
_STATS = struct.Struct("<qqqqqqqqq")


def ints(raw: bytes) -> list[int]:
    """The int64 values packed in ``raw`` (a request's body)."""
    values = array("q")
    values.frombytes(raw)
    return values.tolist()


# ------------------------------------------------------------------------ transfer states

@dataclass(frozen=True)
class TransferStatus:
    """One rank's report on one transfer."""

    transfer_id: int
    state: TransferState
    reason: str = ""
    trailer: Trailer | None = None  # DONE of a received transfer, on rank 0 only


def encode_statuses(statuses: Sequence[TransferStatus]) -> bytes:
    parts = []
    for s in statuses:
        reason, t = s.reason.encode(), s.trailer or Trailer(0, 0)
        parts.append(_STATUS.pack(s.transfer_id, s.state, s.trailer is not None,
                                  t.first_token_id, t.num_cached_tokens, len(reason)) + reason)
    return b"".join(parts)


def decode_statuses(raw: bytes) -> list[TransferStatus]:
    out, offset = [], 0
    while offset < len(raw):
        transfer_id, state, has_trailer, first, cached, n = _STATUS.unpack_from(raw, offset)
        offset += _STATUS.size
        trailer = Trailer(first, cached) if has_trailer else None
        out.append(TransferStatus(transfer_id, TransferState(state),
                                  raw[offset:offset + n].decode(), trailer))
        offset += n
    return out


def status_request(direction: Direction, transfer_ids: Sequence[int]) -> bytes:
    return bytes([Op.STATUS, direction]) + array("q", transfer_ids).tobytes()


def abort_request(direction: Direction, transfer_id: int) -> bytes:
    return bytes([Op.ABORT]) + _DIRECTED_ID.pack(direction, transfer_id)


def decode_directed(request: bytes) -> tuple[Direction, bytes]:
    """The direction of a STATUS or ABORT and the rest of its body."""
    return Direction(request[1]), request[2:]


def decode_abort(request: bytes) -> tuple[Direction, int]:
    direction, transfer_id = _DIRECTED_ID.unpack(request[1:])
    return Direction(direction), int(transfer_id)


# ------------------------------------------------------------------------ figures

@dataclass(frozen=True)
class RankStats:
    """One rank's data-plane figures: transfers pending and channels open in each
    direction, KV payload bytes sent and received, the channel bound (per direction),
    checksum failures (received) and unexpected acknowledgements (counted and ignored by
    the sender) since the start."""

    pending_sent: int = 0
    pending_received: int = 0
    channels_sending: int = 0
    channels_receiving: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    max_channels: int = 0
    checksum_failures: int = 0
    unexpected_acks: int = 0

    def encode(self) -> bytes:
        return _STATS.pack(self.pending_sent, self.pending_received, self.channels_sending,
                           self.channels_receiving, self.bytes_sent, self.bytes_received,
                           self.max_channels, self.checksum_failures, self.unexpected_acks)

    @classmethod
    def decode(cls, raw: bytes) -> RankStats:
        return cls(*_STATS.unpack(raw))


def stats_request() -> bytes:
    return bytes([Op.STATS])


# ------------------------------------------------------------------------ sending

@dataclass(frozen=True)
class SendOrder:
    """Send the blocks of the request computed by ``chunks[chunk_index]`` of this step,
    all but the first ``num_skipped_blocks`` (the receiver holds them)."""

    chunk_index: int
    transfer_id: int
    dest: StoreAddress
    num_skipped_blocks: int = 0


def encode_orders(orders: Sequence[SendOrder]) -> bytes:
    parts = []
    for o in orders:
        host = o.dest.host.encode()
        parts.append(_ORDER.pack(o.chunk_index, o.transfer_id, o.num_skipped_blocks,
                                 o.dest.port, len(host)) + host)
    return b"".join(parts)


def decode_orders(raw: bytes) -> list[SendOrder]:
    out, offset = [], 0
    while offset < len(raw):
        index, transfer_id, skipped, port, n = _ORDER.unpack_from(raw, offset)
        offset += _ORDER.size
        host = raw[offset:offset + n].decode()
        offset += n
        out.append(SendOrder(index, transfer_id, StoreAddress(host, port), skipped))
    return out


def finish_request(transfer_id: int, trailer: Trailer) -> bytes:
    return _FINISH.pack(Op.FINISH, transfer_id, trailer.first_token_id,
                        trailer.num_cached_tokens)


def decode_finish(request: bytes) -> tuple[int, Trailer]:
    _, transfer_id, first_token_id, num_cached_tokens = _FINISH.unpack(request)
    return transfer_id, Trailer(first_token_id, num_cached_tokens)


# ------------------------------------------------------------------------ receiving

@dataclass(frozen=True)
class Expect:
    """A received transfer's ``num_tokens`` tokens of KV go into ``block_ids``; its first
    part must arrive within ``start_timeout_s``, the rest within ``timeout_s`` of it."""

    transfer_id: int
    num_tokens: int
    timeout_s: float
    start_timeout_s: float
    block_ids: tuple[int, ...]

    def encode(self) -> bytes:
        head = _EXPECT.pack(Op.EXPECT, self.transfer_id, self.num_tokens, self.timeout_s,
                            self.start_timeout_s)
        return head + array("q", self.block_ids).tobytes()

    @classmethod
    def decode(cls, raw: bytes) -> Expect:
        _, transfer_id, num_tokens, timeout_s, start_timeout_s = _EXPECT.unpack_from(raw)
        return cls(transfer_id, num_tokens, timeout_s, start_timeout_s,
                   tuple(ints(raw[_EXPECT.size:])))


def address_request() -> bytes:
    return bytes([Op.ADDRESS])


def attach_request(address: StoreAddress) -> bytes:
    return bytes([Op.ATTACH]) + encode_address(address)


def encode_address(address: StoreAddress) -> bytes:
    return f"{address.host}:{address.port}".encode()


def decode_address(raw: bytes) -> StoreAddress:
    host, _, port = raw.decode().rpartition(":")
    return StoreAddress(host, int(port))
