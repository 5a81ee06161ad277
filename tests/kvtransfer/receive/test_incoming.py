"""One incoming transfer's state machine (``kvtransfer.receive.incoming``): a part is verified
before it is written, counted when it is a duplicate, late or invalid; trailers complete
a transfer only with all its layers (no network: hand-made headers)."""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from kvtransfer.errors import ChecksumMismatch
from kvtransfer.receive.incoming import Incoming, RankShard
from kvtransfer.states import TransferState as State
from kvtransfer.stats import ReceiverStats
from kvtransfer.wire.checksum import checksum
from kvtransfer.wire.packing import gather, rows_view, split_rows
from kvtransfer.wire.protocol import (
    DTYPE_CODES,
    MAGIC,
    ChecksumAlgo,
    Flag,
    Kind,
    PartHeader,
    Status,
    Trailer,
)
from tests.kvtransfer.topology import LAYOUT

SRC_IDS, DST_IDS, NUM_TOKENS = [5, 2, 7], [1, 6, 3], 40  # 3 blocks of 16
ROW_BYTES = LAYOUT.row_bytes(LAYOUT.num_kv_heads)
NUM_ROWS = LAYOUT.num_layers * 2 * len(SRC_IDS)


class Receiver:
    """What a receiver hands ``Incoming.deliver``: the rank's shard and its counters;
    ``completed`` collects the layers each delivery completed."""

    def __init__(self) -> None:
        self.shard = RankShard(LAYOUT, 0, 1)
        self.stats = ReceiverStats()
        self.completed: list[tuple[int, int]] = []

    def deliver(self, header: PartHeader, payload: torch.Tensor, record: Incoming) -> Status:
        status, layers = record.deliver(self.shard, header, payload, 1, self.stats)
        self.completed += [(record.transfer_id, layer) for layer in layers]
        return status


def _setup() -> tuple[Receiver, Incoming, torch.Tensor]:
    shape = (LAYOUT.num_layers, 2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    src = torch.randn(shape)
    record = Incoming(transfer_id=9, kv_cache=torch.zeros(shape),
                      block_ids=torch.tensor(DST_IDS), num_tokens=NUM_TOKENS, num_blocks=3,
                      start_deadline=time.monotonic() + 60, timeout_s=60.0,
                      units_per_layer=2 * 3 * LAYOUT.num_kv_heads,
                      units=[0] * LAYOUT.num_layers)
    return Receiver(), record, src


def _part(src: torch.Tensor, rows: tuple[int, int], **changes: int) -> tuple[PartHeader, torch.Tensor]:
    payload = torch.empty((rows[1] - rows[0]) * ROW_BYTES, dtype=torch.uint8)
    view = rows_view(payload, torch.float32, rows[1] - rows[0], LAYOUT.block_size,
                     LAYOUT.num_kv_heads, LAYOUT.head_dim)
    gather(src, torch.tensor(SRC_IDS), (0, LAYOUT.num_kv_heads), 0, 3, rows, view)
    digest = checksum(payload, ChecksumAlgo.XXH3_64)
    fields = dict(
        magic=MAGIC, kind=Kind.DATA, seq=0, transfer_id=9, layout_digest=LAYOUT.digest(),
        num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim,
        dtype_code=DTYPE_CODES[LAYOUT.dtype], block_size=LAYOUT.block_size, num_tokens=NUM_TOKENS,
        layer_start=0, layer_end=LAYOUT.num_layers, head_start=0, head_end=LAYOUT.num_kv_heads,
        row_start=rows[0], row_end=rows[1], payload_nbytes=payload.numel(),
        checksum_algo=int(ChecksumAlgo.XXH3_64),
        checksum=digest - (1 << 64) if digest >= 1 << 63 else digest,
        sender_rank=0, sender_tp_size=1, flags=int(Flag.NONE))
    fields.update(changes)
    return PartHeader(**fields), payload  # type: ignore[arg-type]


def test_all_parts_complete_the_transfer_and_duplicates_are_counted() -> None:
    rx, record, src = _setup()
    parts = split_rows(NUM_ROWS, ROW_BYTES, 4 * ROW_BYTES)
    for rows in parts:
        assert rx.deliver(*_part(src, rows), record) == Status.OK
        again = rx.deliver(*_part(src, rows), record)
        # a duplicate is ignored: OK while the transfer runs, DONE_BEFORE once complete
        assert again == (Status.DONE_BEFORE if rows == parts[-1] else Status.OK)
    assert record.state == State.DONE
    assert (rx.stats.duplicate_parts, rx.stats.late_parts) == (len(parts) - 1, 1)
    assert torch.equal(record.kv_cache[:, :, DST_IDS], src[:, :, SRC_IDS])


def test_a_corrupted_payload_is_never_written() -> None:
    rx, record, src = _setup()
    header, payload = _part(src, (0, 4))
    payload[100] ^= 1
    assert rx.deliver(header, payload, record) == Status.CHECKSUM_MISMATCH
    assert isinstance(record.error, ChecksumMismatch) and not record.kv_cache.any()
    # later parts of the failed transfer are ignored and counted as late
    assert rx.deliver(*_part(src, (4, 8)), record) == Status.NOT_EXPECTED
    assert rx.stats.late_parts == 1 and not record.kv_cache.any()


def test_invalid_parts_fail_the_transfer() -> None:
    for changes in ({"head_end": 3}, {"num_tokens": 41}, {"row_end": NUM_ROWS + 1},
                    {"block_size": 8}, {"payload_nbytes": 5}):
        rx, record, src = _setup()
        assert rx.deliver(*_part(src, (0, 4), **changes), record) == Status.BAD_PART
        assert record.state == State.FAILED and not record.kv_cache.any(), changes


def test_a_cancelled_part_fails_the_transfer() -> None:
    rx, record, src = _setup()
    header, _ = _part(src, (0, 4), flags=int(Flag.CANCELLED), payload_nbytes=0)
    assert rx.deliver(header, torch.empty(0, dtype=torch.uint8), record) \
        == Status.NOT_EXPECTED
    assert record.state == State.FAILED and "aborted" in str(record.error)


def test_blocks_are_written_only_under_the_transfer_lock() -> None:
    rx, record, src = _setup()
    header, payload = _part(src, (0, 4))
    with record.lock:  # as fail()/abort() would hold it
        worker = threading.Thread(target=rx.deliver, args=(header, payload, record))
        worker.start()
        worker.join(0.2)
        assert worker.is_alive() and not record.kv_cache.any()
        record.state = State.FAILED
    worker.join(5)
    assert not record.kv_cache.any()


def _trailer(**changes: int) -> tuple[PartHeader, torch.Tensor]:
    header, _ = _part(torch.zeros(1), (0, 0), kind=Kind.TRAILER, payload_nbytes=0,
                      flags=int(Flag.LAST_PART), first_token_id=42, num_cached_tokens=32,
                      checksum=0)
    return dataclasses.replace(header, **changes), torch.empty(0, dtype=torch.uint8)


def test_a_trailer_completes_the_transfer_only_with_every_layer() -> None:
    rx, record, src = _setup()
    record.wants_trailer = True
    # 1. the trailer first (it may come before another sender rank's layers)
    assert rx.deliver(*_trailer(), record) == Status.OK
    assert record.state == State.PENDING and record.trailer == Trailer(42, 32)
    assert rx.deliver(*_trailer(), record) == Status.OK  # a duplicate, counted
    assert rx.stats.duplicate_parts == 1
    # 2. then every layer: done, each layer reported once as it completes
    for rows in split_rows(NUM_ROWS, ROW_BYTES, 4 * ROW_BYTES):
        assert rx.deliver(*_part(src, rows), record) == Status.OK
    assert record.state == State.DONE
    assert rx.completed == [(9, layer) for layer in range(LAYOUT.num_layers)]


def test_layers_without_the_wanted_trailer_leave_the_transfer_active() -> None:
    rx, record, src = _setup()
    record.wants_trailer = True
    rx.deliver(*_part(src, (0, NUM_ROWS)), record)
    assert record.state == State.PENDING and record.trailer is None


def test_invalid_or_unwanted_trailers_fail_the_transfer() -> None:
    for wants, changes in ((False, {}), (True, {"num_tokens": 41}),
                           (True, {"num_cached_tokens": -1}),
                           (True, {"first_token_id": -1}), (True, {"block_size": 8})):
        rx, record, _ = _setup()
        record.wants_trailer = wants
        assert rx.deliver(*_trailer(**changes), record) == Status.BAD_PART, changes
        assert record.state == State.FAILED and record.trailer is None, changes
    # a cached count past the blocks sent: the receiver held leading blocks (the worker
    # checks the count against the whole prompt)
    rx, record, _ = _setup()
    record.wants_trailer = True
    assert rx.deliver(*_trailer(num_cached_tokens=NUM_TOKENS + 16), record) == Status.OK
    assert record.trailer is not None and record.trailer.num_cached_tokens == NUM_TOKENS + 16
    rx, record, _ = _setup()
    record.wants_trailer = True
    cancelled = _trailer(flags=int(Flag.LAST_PART | Flag.CANCELLED))
    assert rx.deliver(*cancelled, record) == Status.NOT_EXPECTED
    assert record.state == State.FAILED and "aborted" in str(record.error)


def test_the_deadline_starts_over_when_the_first_part_arrives() -> None:
    rx, record, src = _setup()
    record.start_deadline, record.timeout_s = time.monotonic() + 30, 0.2
    # 1. waiting for the transfer to start: the start deadline rules
    assert record.started_at is None and record.deadline == record.start_deadline
    # 2. the first part arrives: from now on it has timeout_s to complete
    assert rx.deliver(*_part(src, (0, 4)), record) == Status.OK
    assert record.started_at is not None and record.deadline == record.started_at + 0.2
    time.sleep(0.3)
    assert rx.deliver(*_part(src, (4, 8)), record) == Status.NOT_EXPECTED
    assert record.state == State.FAILED and "incomplete at the deadline" in str(record.error)


def test_a_transfer_that_never_starts_times_out_naming_it() -> None:
    _, record, _ = _setup()
    assert record.time_out() and "no part arrived" in str(record.error)
