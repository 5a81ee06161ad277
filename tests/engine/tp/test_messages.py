"""The leader → follower step message: a flat int64 array, never pickled objects."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.scheduler import ScheduledChunk
from engine.tp.messages import Op, StepMessage, step_message

INT64_MAX = 2**63 - 1

chunks_strategy = st.builds(
    ScheduledChunk,
    request_id=st.just(""),  # not sent: followers need ids and counts only
    token_ids=st.lists(st.integers(0, 2**31), min_size=1, max_size=40).map(tuple),
    start_position=st.integers(0, 1 << 20),
    block_ids=st.lists(st.integers(0, INT64_MAX), max_size=20).map(tuple),
    sample=st.booleans(),
    all_logits=st.booleans(),
    num_draft_tokens=st.integers(0, 16),
)


def words(*values: int) -> bytes:
    return array("q", values).tobytes()


@settings(deadline=None, max_examples=100)
@given(st.lists(chunks_strategy, max_size=8))
def test_step_message_round_trip(chunks: list[ScheduledChunk]) -> None:
    message = step_message(chunks)
    data = message.encode()
    assert isinstance(data, bytes)
    decoded = StepMessage.decode(data)
    assert decoded == message
    assert decoded.op is Op.STEP and decoded.chunks == tuple(chunks)
    assert StepMessage.decode(decoded.encode()) == decoded


def test_request_ids_are_not_sent() -> None:
    chunk = ScheduledChunk("req-7", (5, 6), 3, (0, 1), True)
    (decoded,) = StepMessage.decode(step_message([chunk]).encode()).chunks
    assert decoded.request_id == ""
    assert (decoded.token_ids, decoded.start_position, decoded.block_ids, decoded.sample) == \
        ((5, 6), 3, (0, 1), True)


def test_encoding_layout() -> None:
    chunks = [ScheduledChunk("", (7, 8, 9), 4, (2,), False),
              ScheduledChunk("", (11,), 10, (3, 5), True)]
    assert step_message(chunks).encode() == words(
        int(Op.STEP), 2, 4, 3, 1, 0, 7, 8, 9, 2, 10, 1, 2, 1, 11, 3, 5, 0)
    # a chunk that wants every row's logits (its prompt's logprobs): flag bit 1
    wants = ScheduledChunk("", (7, 8), 0, (2,), True, all_logits=True)
    assert step_message([wants]).encode() == words(int(Op.STEP), 1, 0, 2, 1, 3, 7, 8, 2, 0)
    assert StepMessage.decode(step_message([wants]).encode()).chunks == (wants,)
    # a speculated chunk's guesses (speculative decoding): their count from flag bit 2 up
    guessed = ScheduledChunk("", (7, 8, 9), 5, (2,), True, num_draft_tokens=2)
    assert step_message([guessed]).encode() == words(int(Op.STEP), 1, 5, 3, 1, 9, 7, 8, 9, 2, 0)
    assert StepMessage.decode(step_message([guessed]).encode()).chunks == (guessed,)


@pytest.mark.parametrize("payload", [b"", b"x", b"12345678", b"123456789", bytes(range(256))])
def test_payload_round_trip(payload: bytes) -> None:
    msg = StepMessage(Op.CALL, (), payload)
    assert len(msg.encode()) % 8 == 0
    assert StepMessage.decode(msg.encode()) == msg


def test_shutdown() -> None:
    data = StepMessage(Op.SHUTDOWN).encode()
    assert data == words(int(Op.SHUTDOWN), 0, 0)
    assert StepMessage.decode(data) == StepMessage(Op.SHUTDOWN, ())


@pytest.mark.parametrize("data", [
    words(int(Op.STEP), 0, 0, 99),  # one trailing word after an empty payload
    words(int(Op.STEP), 1, 0, 1, 0, 1, 5, 0, 6),  # one token declared, an extra word after
    words(int(Op.SHUTDOWN), 0, 0, 0),
], ids=["empty_step", "chunk", "shutdown"])
def test_trailing_words_are_rejected(data: bytes) -> None:
    with pytest.raises(ValueError, match="trailing words"):
        StepMessage.decode(data)


@pytest.mark.parametrize("data", [
    words(int(Op.STEP), 1),  # a chunk announced, none present
    words(int(Op.STEP), 1, 0, 3, 0, 1, 5),  # three tokens declared, one present
    words(int(Op.STEP), 0)[:-1],  # not a whole number of int64 words
    words(99, 0),  # unknown op
], ids=["missing_chunk", "truncated_tokens", "partial_word", "unknown_op"])
def test_malformed_payload_is_rejected(data: bytes) -> None:
    with pytest.raises(ValueError):
        StepMessage.decode(data)


@pytest.mark.parametrize("data", [b"", words(int(Op.STEP))], ids=["empty", "op_only"])
def test_too_short_payload_is_rejected_with_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        StepMessage.decode(data)


@pytest.mark.parametrize("data", [
    words(int(Op.STEP), -5),  # negative chunk count: decodes as no chunks
    words(int(Op.STEP), 1, 0, -1, 1, 1),  # num_tokens -1: a chunk with no tokens
], ids=["num_chunks", "num_tokens"])
def test_negative_counts_are_rejected(data: bytes) -> None:
    with pytest.raises(ValueError):
        StepMessage.decode(data)
