"""The leader <-> rank vocabulary (``worker.kv.messages``) and the reports on it
(``worker.kv.reports``): typed messages round-trip, the leader's per-rank record settles
only on every rank's final report, and the ranks' figures sum by direction."""

from __future__ import annotations

from engine.tp.distributed import StoreAddress
from kvtransfer.errors import TransferTimeout
from kvtransfer.states import TransferState as S
from kvtransfer.wire.protocol import Trailer
from worker.kv.messages import (
    Direction,
    Expect,
    Op,
    RankStats,
    SendOrder,
    TransferStatus,
    abort_request,
    decode_abort,
    decode_address,
    decode_directed,
    decode_finish,
    decode_orders,
    decode_statuses,
    encode_address,
    encode_orders,
    encode_statuses,
    finish_request,
    ints,
    status_request,
)
from worker.kv.reports import RankStates, RankTotals, final_status, poll_transfers, rank_totals


def test_statuses_round_trip_with_and_without_trailers() -> None:
    statuses = [TransferStatus(1, S.PENDING), TransferStatus(2, S.DONE, trailer=Trailer(7, 16)),
                TransferStatus(3, S.FAILED, "rank 1: é broke")]
    assert decode_statuses(encode_statuses(statuses)) == statuses
    assert decode_statuses(b"") == []


def test_directed_calls_name_their_direction() -> None:
    raw = status_request(Direction.RECEIVE, [4, 5])
    assert raw[0] == Op.STATUS
    direction, body = decode_directed(raw)
    assert direction is Direction.RECEIVE and ints(body) == [4, 5]
    assert decode_abort(abort_request(Direction.SEND, 9)) == (Direction.SEND, 9)
    assert Direction.SEND.label == "sent" and Direction.RECEIVE.label == "received"


def test_send_orders_finish_expect_and_addresses_round_trip() -> None:
    orders = [SendOrder(0, 11, StoreAddress("127.0.0.1", 4242)),
              SendOrder(3, 12, StoreAddress("::1", 1))]
    assert decode_orders(encode_orders(orders)) == orders and decode_orders(b"") == []
    assert decode_finish(finish_request(11, Trailer(5, 32))) == (11, Trailer(5, 32))
    expect = Expect(7, 97, 30.0, 2.5, (3, 1, 4))
    assert Expect.decode(expect.encode()) == expect
    address = StoreAddress("10.0.0.7", 50071)
    assert decode_address(encode_address(address)) == address


def test_rank_totals_sum_each_direction() -> None:
    one = RankStats(pending_sent=1, pending_received=2, channels_sending=1, channels_receiving=3,
                    bytes_sent=100, bytes_received=4096, max_channels=8, checksum_failures=1,
                    unexpected_acks=2)
    assert RankStats.decode(one.encode()) == one
    totals = rank_totals(lambda request: [one.encode()] * 3)
    assert totals == RankTotals(3, 6, 12, 300, 3 * 4096, 3, 6)
    assert totals.pending == 9


def test_poll_transfers_reads_every_rank_once() -> None:
    calls: list[bytes] = []

    def call_ranks(request: bytes) -> list[bytes]:
        calls.append(request)
        rank0 = [TransferStatus(1, S.DONE, trailer=Trailer(3, 0)), TransferStatus(2, S.PENDING)]
        rank1 = [TransferStatus(1, S.DONE), TransferStatus(2, S.FAILED, "boom")]
        return [encode_statuses(rank0), encode_statuses(rank1)]

    assert poll_transfers(call_ranks, Direction.SEND, []) == [] and calls == []  # nothing to ask
    first, second = poll_transfers(call_ranks, Direction.RECEIVE, [1, 2])
    assert len(calls) == 1 and decode_directed(calls[0])[0] is Direction.RECEIVE
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
