"""Typed messages from a tensor-parallel leader to its followers.

A step is a list of ``ScheduledChunk`` (ids and counts only), encoded as a flat int64
array — never pickled objects or method names::

    [op, num_chunks, (start_position, num_tokens, num_blocks, sample, *token_ids, *block_ids) * num_chunks]
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from engine.scheduler import ScheduledChunk


class Op(enum.IntEnum):
    STEP = 1
    SHUTDOWN = 2


@dataclass(frozen=True)
class StepMessage:
    op: Op
    chunks: tuple[ScheduledChunk, ...] = ()

    def encode(self) -> bytes:
        words = array("q", [int(self.op), len(self.chunks)])
        for c in self.chunks:
            words.extend((c.start_position, len(c.token_ids), len(c.block_ids), int(c.sample)))
            words.extend(c.token_ids)
            words.extend(c.block_ids)
        return words.tobytes()

    @classmethod
    def decode(cls, data: bytes) -> StepMessage:
        words = array("q")
        words.frombytes(data)
        op, num_chunks = Op(words[0]), words[1]
        chunks, pos = [], 2
        for _ in range(num_chunks):
            start, num_tokens, num_blocks, sample = words[pos : pos + 4]
            pos += 4
            tokens = tuple(words[pos : pos + num_tokens])
            pos += num_tokens
            blocks = tuple(words[pos : pos + num_blocks])
            pos += num_blocks
            chunks.append(ScheduledChunk("", tokens, start, blocks, bool(sample)))
        if pos != len(words):
            raise ValueError(f"malformed step message: {len(words) - pos} trailing words")
        return cls(op, tuple(chunks))


def step_message(chunks: Sequence[ScheduledChunk]) -> StepMessage:
    return StepMessage(Op.STEP, tuple(chunks))
