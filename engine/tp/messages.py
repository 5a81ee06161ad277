"""Typed messages from a tensor-parallel leader to its followers.

A step is a list of ``ScheduledChunk`` (ids and counts only) plus an opaque payload for
the rank plugins (``engine.tp.rank_plugin``), encoded as a flat int64 array — never pickled
objects or method names::

    [op, num_chunks, (start_position, num_tokens, num_blocks, sample, *token_ids, *block_ids) * num_chunks,
     payload_bytes, *payload (zero-padded to whole words)]
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.scheduler import ScheduledChunk


class Op(enum.IntEnum):
    STEP = 1
    SHUTDOWN = 2
    CALL = 3  # a control call for every rank's plugin; the payload is the request


@dataclass(frozen=True)
class StepMessage:
    """One instruction from the leader: run ``chunks`` (``STEP``), answer a plugin call
    (``CALL``) or stop (``SHUTDOWN``). Followers receive no request ids, sampling
    parameters or text: only what the forward pass and the rank plugins need."""

    op: Op
    chunks: tuple[ScheduledChunk, ...] = ()
    payload: bytes = b""

    def encode(self) -> bytes:
        words = array("q", [int(self.op), len(self.chunks)])
        for c in self.chunks:
            flags = int(c.sample) | int(c.all_logits) << 1 | c.num_draft_tokens << 2
            words.extend((c.start_position, len(c.token_ids), len(c.block_ids), flags))
            words.extend(c.token_ids)
            words.extend(c.block_ids)
        words.append(len(self.payload))
        padding = b"\0" * (-len(self.payload) % words.itemsize)
        return words.tobytes() + self.payload + padding

    @classmethod
    def decode(cls, data: bytes) -> StepMessage:
        """Inverse of ``encode``; raises ``ValueError`` on a malformed payload."""
        words = array("q")
        words.frombytes(data)
        reader = _Reader(words)
        op = Op(reader.take(1)[0])
        chunks = []
        for _ in range(reader.count()):
            start, num_tokens, num_blocks, flags = reader.take(1)[0], reader.count(), reader.count(), reader.take(1)[0]
            tokens = tuple(reader.take(num_tokens))
            blocks = tuple(reader.take(num_blocks))
            chunks.append(ScheduledChunk("", tokens, start, blocks, bool(flags & 1),
                                         bool(flags & 2), flags >> 2))
        num_payload_bytes = reader.count()
        payload = reader.take(-(-num_payload_bytes // words.itemsize)).tobytes()[:num_payload_bytes]
        if reader.pos != len(words):
            raise ValueError(f"malformed step message: {len(words) - reader.pos} trailing words")
        return cls(op, tuple(chunks), payload)


class _Reader:
    def __init__(self, words: array) -> None:
        self.words = words
        self.pos = 0

    def take(self, n: int) -> array:
        if self.pos + n > len(self.words):
            raise ValueError("malformed step message: truncated")
        out = self.words[self.pos : self.pos + n]
        self.pos += n
        return out

    def count(self) -> int:
        n = self.take(1)[0]
        if n < 0:
            raise ValueError(f"malformed step message: negative count {n}")
        return n


def step_message(chunks: Sequence[ScheduledChunk], payload: bytes = b"") -> StepMessage:
    return StepMessage(Op.STEP, tuple(chunks), payload)
