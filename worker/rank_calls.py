"""The vocabulary of a worker leader's calls to its ranks' KV plugins (``*_worker.kv_rank``).

A worker's leader drives the KV plugin on every tensor-parallel rank through
``EngineCore.call_ranks(request) -> [reply of rank 0, rank 1, ...]``, between steps.
Requests and replies are small typed messages encoded here (never pickled):

- ``STATUS(transfer_ids)`` → one ``TransferStatus`` per id: pending, done (on a decode
  worker's rank 0: with the ``Trailer`` that arrived) or failed (with the reason). A final
  state is reported once: the rank has then let go of the transfer's blocks;
- ``ABORT(transfer_id)`` → b"\\x01" if the rank knew it; returns once the rank no longer
  touches its blocks (idempotent);
- ``STATS`` → ``RankStats`` (pending transfers, open channels, the channel bound);
- kind-specific ops (``FINISH`` on prefill ranks; ``EXPECT``, ``ADDRESS``, ``ATTACH`` on
  decode ranks) are encoded by the kind's ``kv_rank`` module.

``KVRankPlugin`` answers the shared ops on the rank side; ``RankStates`` and
``poll_transfers`` are the leader side's record of each rank's report.
"""

from __future__ import annotations

import enum
import json
import struct
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from kvtransfer.errors import TransferError
from kvtransfer.protocol import Trailer
from kvtransfer.states import TransferState

C = TypeVar("C", bound="JsonConfig")


class Op(enum.IntEnum):
    STATUS = 1
    ABORT = 2
    STATS = 3
    FINISH = 4  # prefill: every layer was sent; rank 0 queues the trailer
    EXPECT = 5  # decode: blocks the transfer's KV goes into
    ADDRESS = 6  # decode: rank 0's rendezvous store address
    ATTACH = 7  # decode: other ranks start their receivers on that store


# transfer_id, state, has trailer, first token id, cached tokens, len(reason); then reason
_STATUS = struct.Struct("<qBBqqI")
# pending, open channels, max channels, bytes moved, checksum failures
_STATS = struct.Struct("<qqqqqq")
_ID = struct.Struct("<q")


@dataclass(frozen=True)
class TransferStatus:
    """One rank's report on one transfer."""

    transfer_id: int
    state: TransferState
    reason: str = ""
    trailer: Trailer | None = None  # DONE on a decode worker's rank 0 only


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


def status_request(transfer_ids: Sequence[int]) -> bytes:
    return bytes([Op.STATUS]) + array("q", transfer_ids).tobytes()


def abort_request(transfer_id: int) -> bytes:
    return bytes([Op.ABORT]) + _ID.pack(transfer_id)


def stats_request() -> bytes:
    return bytes([Op.STATS])


def ints(raw: bytes) -> list[int]:
    """The int64 values packed in ``raw`` (a request's body)."""
    values = array("q")
    values.frombytes(raw)
    return values.tolist()


@dataclass(frozen=True)
class RankStats:
    """One rank's data-plane figures: transfers pending, channels open and their bound,
    KV payload bytes moved (sent, or received), checksum failures and unexpected
    acknowledgements (counted and ignored by a sender) since the start."""

    pending: int
    open_channels: int
    max_channels: int
    bytes_moved: int = 0
    checksum_failures: int = 0
    unexpected_acks: int = 0

    def encode(self) -> bytes:
        return _STATS.pack(self.pending, self.open_channels, self.max_channels,
                           self.bytes_moved, self.checksum_failures, self.unexpected_acks)

    @classmethod
    def decode(cls, raw: bytes) -> RankStats:
        return cls(*_STATS.unpack(raw))


@dataclass(frozen=True)
class RankTotals:
    """``RankStats`` summed over a worker's ranks."""

    pending: int = 0
    open_channels: int = 0
    bytes_moved: int = 0
    checksum_failures: int = 0
    unexpected_acks: int = 0


def rank_totals(replies: Sequence[bytes]) -> RankTotals:
    """The ranks' ``STATS`` replies, summed."""
    stats = [RankStats.decode(r) for r in replies]
    return RankTotals(sum(s.pending for s in stats), sum(s.open_channels for s in stats),
                      sum(s.bytes_moved for s in stats), sum(s.checksum_failures for s in stats),
                      sum(s.unexpected_acks for s in stats))


class JsonConfig:
    """Mixin of the plugins' frozen config dataclasses: ``EngineConfig.rank_plugin_config``
    is their JSON."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[C], raw: str) -> C:
        """Parse; unknown or missing keys raise ``ValueError``."""
        try:
            return cls(**json.loads(raw))
        except TypeError as exc:
            raise ValueError(f"bad {cls.__name__}: {exc}") from exc


def final_status(transfer_id: int, done: Callable[[int], bool],
                 wait: Callable[[int], Trailer | None], *, unknown: str = "unknown transfer"
                 ) -> TransferStatus:
    """A rank's report from its sender or receiver: pending while ``done`` is False, else
    the outcome of ``wait`` (after which the data plane has forgotten the transfer);
    ``unknown`` is the reason given for a transfer the data plane does not know."""
    try:
        if not done(transfer_id):
            return TransferStatus(transfer_id, TransferState.PENDING)
        trailer = wait(transfer_id)
    except KeyError:
        return TransferStatus(transfer_id, TransferState.FAILED, unknown)
    except TransferError as exc:
        return TransferStatus(transfer_id, TransferState.FAILED, f"{type(exc).__name__}: {exc}")
    return TransferStatus(transfer_id, TransferState.DONE, trailer=trailer)


class KVRankPlugin:
    """Rank side of the shared ops; a kind's plugin implements ``status``, ``abort``,
    ``stats`` and ``handle_own`` for its own ops."""

    def handle(self, request: bytes) -> bytes:
        op = Op(request[0])
        if op is Op.STATUS:
            return encode_statuses([self.status(t) for t in ints(request[1:])])
        if op is Op.ABORT:
            return b"\x01" if self.abort(_ID.unpack(request[1:])[0]) else b"\x00"
        if op is Op.STATS:
            return self.stats().encode()
        return self.handle_own(op, request)

    def status(self, transfer_id: int) -> TransferStatus:
        raise NotImplementedError

    def abort(self, transfer_id: int) -> bool:
        raise NotImplementedError

    def stats(self) -> RankStats:
        raise NotImplementedError

    def handle_own(self, op: Op, request: bytes) -> bytes:
        raise ValueError(f"op {op.name} is not served by {type(self).__name__}")


@dataclass
class RankStates:
    """The leader's record of what each rank reported on one transfer."""

    tp_size: int
    states: list[TransferState] = field(init=False)
    reasons: list[str] = field(default_factory=list)
    trailer: Trailer | None = None

    def __post_init__(self) -> None:
        self.states = [TransferState.PENDING] * self.tp_size

    def update(self, statuses: Sequence[TransferStatus]) -> None:
        """Take one report per rank (rank order); a final state, once reported, stays."""
        for rank, status in enumerate(statuses):
            if self.states[rank] is not TransferState.PENDING:
                continue
            self.states[rank] = status.state
            if status.trailer is not None:
                self.trailer = status.trailer
            if status.reason:
                self.reasons.append(f"rank {rank}: {status.reason}")

    def fail(self, reason: str) -> None:
        self.reasons.append(reason)
        self.states[0] = TransferState.FAILED

    @property
    def failed(self) -> bool:
        return TransferState.FAILED in self.states

    @property
    def done(self) -> bool:
        return all(s is TransferState.DONE for s in self.states)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def poll_transfers(call_ranks: Callable[[bytes], list[bytes]], transfer_ids: Sequence[int]
                   ) -> list[list[TransferStatus]]:
    """Every rank's status of each transfer: ``result[i][rank]`` is about ``transfer_ids[i]``."""
    if not transfer_ids:
        return []
    per_rank = [decode_statuses(r) for r in call_ranks(status_request(transfer_ids))]
    return [[statuses[i] for statuses in per_rank] for i in range(len(transfer_ids))]


def unpack_id(raw: bytes) -> int:
    return int(_ID.unpack(raw)[0])

