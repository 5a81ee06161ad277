"""Wire messages: fixed, typed, checked; never pickled."""

from __future__ import annotations

import dataclasses

import pytest

from engine.tp.distributed import ABORT_TAG
from kvtransfer.wire.protocol import (
    DTYPE_CODES,
    MAGIC,
    MAX_SEQ,
    Ack,
    ChecksumAlgo,
    Flag,
    Kind,
    OpenReply,
    OpenRequest,
    OpenStatus,
    PartHeader,
    ReceiverInfo,
    Status,
    Trailer,
)
from tests.kvtransfer.topology import LAYOUT


def make_header(**changes: int) -> PartHeader:
    header = PartHeader(
        MAGIC, Kind.DATA, 7, 123456789, LAYOUT.digest(), LAYOUT.num_layers, LAYOUT.num_kv_heads,
        LAYOUT.head_dim, DTYPE_CODES[LAYOUT.dtype], LAYOUT.block_size, 77, 0, 3, 0, 2, 4, 8,
        4096, int(ChecksumAlgo.XXH3_64), -(1 << 62), 1, 2, int(Flag.LAST_PART))
    return dataclasses.replace(header, **changes)


def test_header_round_trips() -> None:
    header = make_header()
    words = header.encode()
    assert len(words) == PartHeader.WORDS
    assert PartHeader.decode(words) == header
    assert header.is_last and header.check_layout(LAYOUT) is None


def test_corrupted_header_is_rejected() -> None:
    words = make_header().encode()
    words[3] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        PartHeader.decode(words)
    with pytest.raises(ValueError, match="magic"):
        PartHeader.decode(make_header(magic=MAGIC + 1).encode())
    with pytest.raises(ValueError, match="words"):
        PartHeader.decode(make_header().encode()[:-1])


def test_header_names_a_layout_mismatch() -> None:
    assert make_header(block_size=32).check_layout(LAYOUT) == "block_size: 16 != 32"
    other = dataclasses.replace(LAYOUT, hash_seed=3)
    assert make_header().check_layout(other).startswith("fingerprint")  # type: ignore[union-attr]


def test_trailer_header_round_trips_under_the_header_checksum() -> None:
    header = make_header(kind=Kind.TRAILER, payload_nbytes=0, first_token_id=613,
                         num_cached_tokens=48)
    words = header.encode()
    assert PartHeader.decode(words).trailer == Trailer(613, 48)
    words[-3] ^= 1  # the first token id, changed in flight
    with pytest.raises(ValueError, match="checksum"):
        PartHeader.decode(words)


def test_closing_header() -> None:
    header = PartHeader.decode(PartHeader.closing(5).encode())
    assert header.kind == Kind.CLOSE and header.seq == 5 and header.payload_nbytes == 0


def test_ack_round_trips() -> None:
    ack = Ack(2**40, 9, Status.CHECKSUM_MISMATCH)
    assert Ack.decode(ack.encode()) == ack
    words = ack.encode()
    words[2] = int(Status.OK)
    with pytest.raises(ValueError):
        Ack.decode(words)


def test_tags_fit_and_never_hit_the_abort_tag() -> None:
    assert MAX_SEQ < ABORT_TAG < 2**31


def test_rendezvous_messages_round_trip() -> None:
    info = ReceiverInfo(LAYOUT, 2)
    assert ReceiverInfo.decode(info.encode()) == info
    req = OpenRequest(3, "prefill-ä", 1, 2, 0, "gloo", LAYOUT)
    assert OpenRequest.decode(req.encode()) == req
    reply = OpenReply(OpenStatus.LAYOUT_MISMATCH, 2, 4 << 20, "block_size: 16 != 32")
    assert OpenReply.decode(reply.encode()) == reply


@pytest.mark.parametrize("mangle", [lambda b: b[:-1], lambda b: b + b"\0", lambda b: b"x" + b[1:]])
def test_malformed_rendezvous_messages_are_rejected(mangle) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        OpenRequest.decode(mangle(OpenRequest(3, "p", 0, 1, 0, "gloo", LAYOUT).encode()))
