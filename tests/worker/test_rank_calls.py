"""The leader <-> rank vocabulary (``worker.rank_calls``): typed messages round-trip, the
shared ops are answered once for every plugin, and the leader's per-rank record settles
only on every rank's final report."""

from __future__ import annotations

import pytest

from kvtransfer.errors import TransferTimeout
from kvtransfer.protocol import Trailer
from kvtransfer.states import TransferState as S
from worker.rank_calls import (
    KVRankPlugin,
    Op,
    RankStates,
    RankStats,
    RankTotals,
    TransferStatus,
    abort_request,
    decode_statuses,
    encode_statuses,
    final_status,
    poll_transfers,
    rank_totals,
    stats_request,
    status_request,
)


def test_statuses_round_trip_with_and_without_trailers() -> None:
    statuses = [TransferStatus(1, S.PENDING), TransferStatus(2, S.DONE, trailer=Trailer(7, 16)),
                TransferStatus(3, S.FAILED, "rank 1: é broke")]
    assert decode_statuses(encode_statuses(statuses)) == statuses
    assert decode_statuses(b"") == []


class Plugin(KVRankPlugin):
    def __init__(self) -> None:
        self.aborted: list[int] = []

    def status(self, transfer_id: int) -> TransferStatus:
        return TransferStatus(transfer_id, S.DONE if transfer_id % 2 else S.PENDING)

    def abort(self, transfer_id: int) -> bool:
        self.aborted.append(transfer_id)
        return transfer_id == 5

    def stats(self) -> RankStats:
        return RankStats(2, 1, 8, bytes_moved=4096, checksum_failures=1, unexpected_acks=2)


def test_the_shared_ops_are_answered_by_the_base_plugin() -> None:
    plugin = Plugin()
    assert decode_statuses(plugin.handle(status_request([1, 2]))) == [
        TransferStatus(1, S.DONE), TransferStatus(2, S.PENDING)]
    assert plugin.handle(abort_request(5)) == b"\x01"
    assert plugin.handle(abort_request(6)) == b"\x00" and plugin.aborted == [5, 6]
    assert RankStats.decode(plugin.handle(stats_request())) == RankStats(2, 1, 8, 4096, 1, 2)
    with pytest.raises(ValueError, match="FINISH"):
        plugin.handle(bytes([Op.FINISH]))
    assert rank_totals([plugin.handle(stats_request())] * 3) == RankTotals(6, 3, 3 * 4096, 3, 6)


def test_poll_transfers_reads_every_rank_once() -> None:
    calls: list[bytes] = []

    def call_ranks(request: bytes) -> list[bytes]:
        calls.append(request)
        rank0 = [TransferStatus(1, S.DONE, trailer=Trailer(3, 0)), TransferStatus(2, S.PENDING)]
        rank1 = [TransferStatus(1, S.DONE), TransferStatus(2, S.FAILED, "boom")]
        return [encode_statuses(rank0), encode_statuses(rank1)]

    assert poll_transfers(call_ranks, []) == [] and calls == []  # nothing to ask
    first, second = poll_transfers(call_ranks, [1, 2])
    assert len(calls) == 1
    assert [s.state for s in first] == [S.DONE, S.DONE] and first[0].trailer == Trailer(3, 0)
    assert [s.state for s in second] == [S.PENDING, S.FAILED]


def test_rank_states_settle_on_every_rank_and_keep_final_states() -> None:
    ranks = RankStates(2)
    ranks.update([TransferStatus(1, S.DONE, trailer=Trailer(9, 4)), TransferStatus(1, S.PENDING)])
    assert not ranks.done and not ranks.failed
    # a final state once reported stays, whatever a later report says
    ranks.update([TransferStatus(1, S.FAILED, "late"), TransferStatus(1, S.DONE)])
    assert ranks.done and ranks.trailer == Trailer(9, 4) and ranks.reason == ""
    failed = RankStates(2)
    failed.update([TransferStatus(1, S.PENDING), TransferStatus(1, S.FAILED, "timeout")])
    assert failed.failed and not failed.done and failed.reason == "rank 1: timeout"


def test_final_status_reports_pending_done_unknown_and_failed() -> None:
    def wait(transfer_id: int) -> Trailer | None:
        if transfer_id == 3:
            raise TransferTimeout("KV incomplete at the deadline", 3)
        return Trailer(1, 0)

    assert final_status(1, lambda t: False, wait).state is S.PENDING
    assert final_status(2, lambda t: True, wait) == TransferStatus(2, S.DONE, trailer=Trailer(1, 0))
    failed = final_status(3, lambda t: True, wait)
    assert failed.state is S.FAILED and failed.reason.startswith("TransferTimeout: transfer 3")

    def unknown(transfer_id: int) -> bool:
        raise KeyError(transfer_id)

    assert final_status(4, unknown, wait, unknown="never sent").reason == "never sent"
