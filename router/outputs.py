"""What a request streams back, as the router's dataclasses (no protobuf): ``OutputChunk``s,
the last with its finish reason and ``Usage``. ``router.worker_calls`` builds them from the
decode worker's stream, ``router.api`` turns them into ``pdserve.v1`` responses."""

from __future__ import annotations

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
