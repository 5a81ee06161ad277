"""What a request streams back, as the router's dataclasses (no protobuf): ``OutputChunk``s,
the last with its finish reason and ``Usage``. ``router.worker_calls`` builds them from the
decode worker's stream, ``router.api`` turns them into ``pdserve.v1`` responses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.sampling_params import TokenLogprobs


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class OutputChunk:
    """New tokens of a request and their text; the last has ``finish_reason`` and usage."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    worker_s: float | None = None  # a stream's first chunk: the decode worker's time to it
    # when the request asked for logprobs: one per token (but see ``TokenChunk.logprobs``:
    # a handoff's first token's come with the Prefill's reply, ``router.lifecycle.relay``)
    logprobs: tuple[TokenLogprobs, ...] = ()
    index: int = 0  # the choice it belongs to (n > 1: ``router.parallel``)
    # a choice's first chunk, when the request asked for them: prompt tokens 1.. (from
    # the Prefill's reply, or the decode worker's first chunk when colocated)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


def merge_chunks(chunks: Sequence[OutputChunk]) -> OutputChunk:
    """Consecutive chunks of one choice as one: tokens, text and logprobs in order; the
    first's ``worker_s``, the last's finish and usage."""
    if len(chunks) == 1:
        return chunks[0]
    first, last = chunks[0], chunks[-1]
    return OutputChunk(tuple(t for c in chunks for t in c.token_ids),
                       "".join(c.text for c in chunks), last.finish_reason, last.usage,
                       first.worker_s, tuple(lp for c in chunks for lp in c.logprobs),
                       first.index, tuple(lp for c in chunks for lp in c.prompt_logprobs))
