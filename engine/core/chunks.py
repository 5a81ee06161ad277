"""What one step computes of one request (``ScheduledChunk``), and the pure functions the
scheduler (``engine.core.scheduler``) makes and weighs chunks with. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from engine.core.request import Request
from engine.kvcache import BlockHash


class ScheduledChunk(NamedTuple):
    """Tokens ``[start_position, start_position + len(token_ids))`` of one request, computed
    this step into ``block_ids`` (the request's whole block table). ``sample``: the chunk
    reaches the end of the sequence, so the next token is sampled. ``all_logits``: the
    logits of every token of the chunk are wanted (its prompt's logprobs), not only the
    last one's. ``num_draft_tokens``: the last that many tokens are guesses of a decoding
    request (speculative decoding): every token's logits are sampled from, and
    ``Scheduler.update`` keeps the guesses the model agrees with. The runner computes such
    a chunk as decode rows, each token attending up to itself (a draft model's short
    catch-up uses that too: ``engine.core.drafter``).

    Immutable (``_replace`` makes a changed copy). A named tuple, not a frozen dataclass:
    one is made per running request per step, and a frozen dataclass takes about 2.5
    times as long to make."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool
    all_logits: bool = False
    num_draft_tokens: int = 0

    @property
    def is_decode(self) -> bool:
        return self.sample and len(self.token_ids) == 1

    @property
    def num_logit_rows(self) -> int:
        """Rows of logits the forward returns for it (``ModelRunner.execute``)."""
        if self.all_logits or self.num_draft_tokens:
            return len(self.token_ids)
        return int(self.sample)


def decode_chunk(request: Request, block_ids: tuple[int, ...],
                 block_size: int) -> ScheduledChunk | None:
    """``request``'s next chunk when it is one decode token whose KV has room in
    ``block_ids`` (the usual chunk: nothing to allocate, made once per running request
    per step), as ``next_chunk`` makes it; else None."""
    start = request.num_computed_tokens
    if start + 1 != len(request.all_token_ids) or start >= len(block_ids) * block_size:
        return None
    return ScheduledChunk(request.request_id, (request.all_token_ids[start],), start,
                          block_ids, True)


def next_chunk(request: Request, num_new: int, drafts: Sequence[int],
               block_ids: tuple[int, ...]) -> ScheduledChunk:
    """The chunk of ``request``'s next ``num_new`` tokens to compute (then ``drafts``, its
    guesses), into ``block_ids``."""
    start = request.num_computed_tokens
    if num_new == 1 and not drafts and start + 1 == len(request.all_token_ids):
        # a decode token (the usual chunk, made once per running request per step): what
        # the general case makes of it, without its arithmetic
        return ScheduledChunk(request.request_id, (request.all_token_ids[start],), start,
                              block_ids, True)
    tokens = request.all_token_ids[start : start + num_new]
    return ScheduledChunk(
        request_id=request.request_id,
        token_ids=(*tokens, *drafts) if drafts else tuple(tokens),
        start_position=start,
        block_ids=block_ids,
        sample=start + num_new == request.num_tokens,
        all_logits=request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1,
        num_draft_tokens=len(drafts),
    )


def blocks_completed(chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request],
                     block_size: int, seed: int) -> set[BlockHash]:
    """The hashes of the blocks ``chunks`` complete (``requests``: theirs, by id)."""
    done: set[BlockHash] = set()
    for chunk in chunks:
        first = chunk.start_position // block_size
        end = (chunk.start_position + len(chunk.token_ids)) // block_size
        done.update(requests[chunk.request_id].full_block_hashes(end, block_size, seed)[first:])
    return done


def next_block_hash(request: Request, num_cached: int, block_size: int,
                    seed: int) -> BlockHash | None:
    """The hash of the request's first block past its ``num_cached`` cached ones, where the
    prefix cache could serve it (None: that block holds its last token, or its prompt's
    logprobs are wanted, which a cached block has not)."""
    if request.wants_prompt_logprobs or (request.num_tokens - 1) // block_size <= num_cached:
        return None
    return request.full_block_hashes(num_cached + 1, block_size, seed)[num_cached]
