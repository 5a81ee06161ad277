"""What ranks report on a transfer, and how the leader folds every rank's report.

Rank side: ``final_status`` turns what a ``KVSender`` or ``KVReceiver`` knows of one
transfer into a ``TransferStatus``. Leader side: ``poll_transfers`` asks every rank at
once, ``RankStates`` keeps each rank's final state of one transfer (a final state, once
reported, stays), ``rank_totals`` sums the ranks' ``RankStats``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtransfer.errors import TransferError
from kvtransfer.states import TransferState
from kvtransfer.wire.protocol import Trailer
from worker.kv.messages import (
    Direction,
    RankStats,
    TransferStatus,
    decode_statuses,
    stats_request,
    status_request,
)


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


def poll_transfers(call_ranks: Callable[[bytes], list[bytes]], direction: Direction,
                   transfer_ids: Sequence[int]) -> list[list[TransferStatus]]:
    """Every rank's status of each transfer: ``result[i][rank]`` is about ``transfer_ids[i]``."""
    if not transfer_ids:
        return []
    per_rank = [decode_statuses(r) for r in call_ranks(status_request(direction, transfer_ids))]
    return [[statuses[i] for statuses in per_rank] for i in range(len(transfer_ids))]


@dataclass(frozen=True)
class RankTotals:
    """``RankStats`` summed over a worker's ranks (bytes and pending transfers by
    direction, channels of both directions together)."""

    pending_sent: int = 0
    pending_received: int = 0
    open_channels: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    checksum_failures: int = 0
    unexpected_acks: int = 0

    @property
    def pending(self) -> int:
        return self.pending_sent + self.pending_received


def rank_totals(call_ranks: Callable[[bytes], list[bytes]]) -> RankTotals:
    """Every rank's ``STATS``, summed."""
    stats = [RankStats.decode(r) for r in call_ranks(stats_request())]
    return RankTotals(sum(s.pending_sent for s in stats), sum(s.pending_received for s in stats),
                      sum(s.channels_sending + s.channels_receiving for s in stats),
                      sum(s.bytes_sent for s in stats), sum(s.bytes_received for s in stats),
                      sum(s.checksum_failures for s in stats),
                      sum(s.unexpected_acks for s in stats))
