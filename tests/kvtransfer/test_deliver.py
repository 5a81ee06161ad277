"""How a receiver takes one part: verified before it is written, counted when it is a
duplicate, late or invalid; trailers complete a transfer only with all its layers (no
network: a receiver stand-in and hand-made headers)."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import torch

from kvtransfer.checksum import checksum
from kvtransfer.errors import ChecksumMismatch, TransferError
from kvtransfer.packing import gather, rows_view, split_rows
from kvtransfer.protocol import (
    DTYPE_CODES,
    MAGIC,
    ChecksumAlgo,
    Flag,
    Kind,
    PartHeader,
    Status,
    Trailer,
)
from kvtransfer.receiver import Incoming, ReceiverStats, State
from kvtransfer.recv_channel import deliver_part
from tests.kvtransfer.topology import LAYOUT

SRC_IDS, DST_IDS, NUM_TOKENS = [5, 2, 7], [1, 6, 3], 40  # 3 blocks of 16
ROW_BYTES = LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4
NUM_ROWS = LAYOUT.num_layers * 2 * len(SRC_IDS)


class Receiver(SimpleNamespace):
    def fail(self, record: Incoming, error: TransferError) -> None:
        with record.lock:
            if record.state == State.ACTIVE:
                record.state, record.error = State.FAILED, error


def _setup() -> tuple[Receiver, Incoming, torch.Tensor]:
    shape = (LAYOUT.num_layers, 2, 8, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    src = torch.randn(shape)
    rx = Receiver(layout=LAYOUT, tp_rank=0, tp_size=1, stats=ReceiverStats(),
                  on_layer_received=None)
    record = Incoming(9, torch.zeros(shape), torch.tensor(DST_IDS), NUM_TOKENS, 3,
                      time.monotonic() + 60, 2 * 3 * LAYOUT.num_kv_heads,
                      [0] * LAYOUT.num_layers)
    return rx, record, src


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
        assert deliver_part(rx, *_part(src, rows), record, 1) == Status.OK
        again = deliver_part(rx, *_part(src, rows), record, 1)
        # a duplicate is ignored: OK while the transfer runs, DONE_BEFORE once complete
        assert again == (Status.DONE_BEFORE if rows == parts[-1] else Status.OK)
    assert record.state == State.DONE
    assert (rx.stats.duplicate_parts, rx.stats.late_parts) == (len(parts) - 1, 1)
    assert torch.equal(record.kv_cache[:, :, DST_IDS], src[:, :, SRC_IDS])


def test_a_corrupted_payload_is_never_written() -> None:
    rx, record, src = _setup()
    header, payload = _part(src, (0, 4))
    payload[100] ^= 1
    assert deliver_part(rx, header, payload, record, 1) == Status.CHECKSUM_MISMATCH
    assert isinstance(record.error, ChecksumMismatch) and not record.kv_cache.any()
    # later parts of the failed transfer are ignored and counted as late
    assert deliver_part(rx, *_part(src, (4, 8)), record, 1) == Status.NOT_EXPECTED
    assert rx.stats.late_parts == 1 and not record.kv_cache.any()


def test_invalid_parts_fail_the_transfer() -> None:
    for changes in ({"head_end": 3}, {"num_tokens": 41}, {"row_end": NUM_ROWS + 1},
                    {"block_size": 8}, {"payload_nbytes": 5}):
        rx, record, src = _setup()
        assert deliver_part(rx, *_part(src, (0, 4), **changes), record, 1) == Status.BAD_PART
        assert record.state == State.FAILED and not record.kv_cache.any(), changes


def test_a_cancelled_part_fails_the_transfer() -> None:
    rx, record, src = _setup()
    header, _ = _part(src, (0, 4), flags=int(Flag.CANCELLED), payload_nbytes=0)
    assert deliver_part(rx, header, torch.empty(0, dtype=torch.uint8), record, 1) \
        == Status.NOT_EXPECTED
    assert record.state == State.FAILED and "aborted" in str(record.error)


def test_blocks_are_written_only_under_the_transfer_lock() -> None:
    rx, record, src = _setup()
    header, payload = _part(src, (0, 4))
    with record.lock:  # as fail()/abort() would hold it
        worker = threading.Thread(target=deliver_part, args=(rx, header, payload, record, 1))
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
    assert deliver_part(rx, *_trailer(), record, 1) == Status.OK
    assert record.state == State.ACTIVE and record.trailer == Trailer(42, 32)
    assert deliver_part(rx, *_trailer(), record, 1) == Status.OK  # a duplicate, counted
    assert rx.stats.duplicate_parts == 1
    # 2. then every layer: done, each layer reported once as it completes
    layers: list[tuple[int, int]] = []
    rx.on_layer_received = lambda transfer_id, layer: layers.append((transfer_id, layer))
    for rows in split_rows(NUM_ROWS, ROW_BYTES, 4 * ROW_BYTES):
        assert deliver_part(rx, *_part(src, rows), record, 1) == Status.OK
    assert record.state == State.DONE
    assert layers == [(9, layer) for layer in range(LAYOUT.num_layers)]


def test_layers_without_the_wanted_trailer_leave_the_transfer_active() -> None:
    rx, record, src = _setup()
    record.wants_trailer = True
    deliver_part(rx, *_part(src, (0, NUM_ROWS)), record, 1)
    assert record.state == State.ACTIVE and record.trailer is None


def test_invalid_or_unwanted_trailers_fail_the_transfer() -> None:
    for wants, changes in ((False, {}), (True, {"num_tokens": 41}),
                           (True, {"num_cached_tokens": NUM_TOKENS + 1}),
                           (True, {"first_token_id": -1}), (True, {"block_size": 8})):
        rx, record, _ = _setup()
        record.wants_trailer = wants
        assert deliver_part(rx, *_trailer(**changes), record, 1) == Status.BAD_PART, changes
        assert record.state == State.FAILED and record.trailer is None, changes
    rx, record, _ = _setup()
    record.wants_trailer = True
    cancelled = _trailer(flags=int(Flag.LAST_PART | Flag.CANCELLED))
    assert deliver_part(rx, *cancelled, record, 1) == Status.NOT_EXPECTED
    assert record.state == State.FAILED and "aborted" in str(record.error)
