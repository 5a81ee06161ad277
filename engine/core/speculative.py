"""Speculative decoding by n-gram lookup (vLLM's ``{"method": "ngram", ...}``): a
decoding request's next tokens are guessed from its own history, computed in one chunk
with its last token, and kept as far as the model agrees. Torch-free.

- Proposal (``propose_ngram``): the longest suffix of the sequence, between
  ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens, that occurred before; the up to
  ``num_speculative_tokens`` tokens that followed its latest earlier occurrence are the
  drafts. Input-grounded output (a summary quoting its source, code being edited) repeats
  its prompt, so the guesses are often right; nothing found, nothing is speculated.
- Verification (``accepted``): the chunk ``[last token, d_1 … d_k]`` gives the model's
  distribution after each; the sampler draws a token from each exactly as it would
  without speculation (greedy: the argmax; seeded: the draw of that seed and position).
  Draft ``d_i`` is kept while it equals the token drawn in its place; the first token
  drawn that differs (or the one after the last draft) is kept too and ends the step. So
  every token is the one the sampler gives for the history before it: greedy and seeded
  streams equal the non-speculative ones token for token, and an unseeded stream keeps
  the model's distribution — for a draft that is one token with certainty, keeping it
  exactly when the draw equals it is rejection sampling (kept with probability
  ``p(d_i)``, else drawn from ``p`` without ``d_i``).
- KV: the chunk writes K/V for every draft; the request's computed tokens then cover its
  last token and the drafts kept, so a rejected draft's K/V lies past them (overwritten
  by the next step) and is never in a block the prefix cache keys.

The draft-model method (``{"method": "draft_model", ...}``, ``engine.core.drafter``) uses
the same rules and the same verification: ``drafts_for`` reserves its guesses' slots
(``DRAFT_PLACEHOLDER`` tokens), which the draft model fills before the step runs.

A request speculates when its output is chosen from the raw logits alone and its end
checked token by token: no penalties, bias or ``min_tokens`` (they read the history a
draft would change), no structured output, logprobs or stop strings. The others in the
same batch decode as before.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.config import SchedulerConfig
    from engine.core.request import Request
    from engine.kvcache import BlockManager
    from engine.sampling_params import SamplingParams


# A draft model's guesses are slots when scheduled: ``engine.core.drafter`` writes the
# tokens into the chunk before the step runs.
DRAFT_PLACEHOLDER = 0


class ScheduledChunk(Protocol):
    """What is read here of ``engine.core.chunks.ScheduledChunk`` (the scheduler, which
    imports this module, makes them)."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def start_position(self) -> int: ...
    @property
    def sample(self) -> bool: ...
    @property
    def num_draft_tokens(self) -> int: ...


def propose_ngram(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` drafts continuing ``tokens`` (see the module docstring): the tokens
    after the latest earlier occurrence of its longest suffix of ``n_min``..``n_max``
    tokens that occurred before."""
    total = len(tokens)
    if k < 1 or total < n_min + 1:
        return []
    data = array("q", tokens).tobytes()
    width = 8
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        pattern = data[-n * width:]
        end = (total - 1) * width  # an occurrence must be followed by a token
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:
                follow = at // width + n
                return list(tokens[follow:follow + k])
            end = at + len(pattern) - 1  # misaligned: look further back
    return []


def drafts_for(request: Request, config: SchedulerConfig, blocks: BlockManager, budget: int,
               max_model_len: int, later: int, later_blocks: int) -> list[int]:
    """The guesses a decoding request computes this step: as many as ``config`` asks and
    the rest of the step leaves room for — the token ``budget`` less one token for each of
    the ``later`` running requests still to be scheduled, and the free blocks less the
    ``later_blocks`` their next chunks may take (a guess never preempts or starves another
    request) — its ``max_tokens`` and the context. None for a request that does not
    speculate, or whose last token is still its prompt's (the first output token is the
    prefill's, alone)."""
    if (not config.speculative_method or not may_speculate(request)
            or request.num_computed_tokens < request.num_prompt_tokens):
        return []
    held = len(blocks.block_table(request.request_id)) if blocks.has_request(
        request.request_id) else 0
    spare = (held + max(0, blocks.num_free_blocks - later_blocks)) * blocks.block_size
    room = min(config.num_speculative_tokens, budget - later - 1,
               spare - request.num_tokens,
               request.params.max_tokens - request.num_output_tokens - 1,
               max_model_len - request.num_tokens - 1)
    if room < 1:
        return []
    if config.speculative_method == "draft_model":  # the draft model fills them in the step
        return [DRAFT_PLACEHOLDER] * room
    return propose_ngram(request.all_token_ids, room, config.prompt_lookup_max,
                         config.prompt_lookup_min)


def blocks_wanted_after(running: Sequence[Request], blocks: BlockManager, budget: int
                        ) -> list[int]:
    """For each of the ``running`` requests, the free blocks the ones after it may take
    this step: each one's next chunk, of at most ``budget`` tokens, and at least one block
    (what a guess must leave them)."""
    after, total = [0] * len(running), 0
    for i in range(len(running) - 1, -1, -1):
        after[i] = total
        r = running[i]
        upto = r.num_computed_tokens + min(r.num_tokens - r.num_computed_tokens, budget)
        held = len(blocks.block_table(r.request_id)) if blocks.has_request(r.request_id) else 0
        total += max(1, -(-upto // blocks.block_size) - held)
    return after


def may_speculate(request: Request) -> bool:
    """Whether ``request`` may ever guess: it decodes here (not prefill-only) and its
    sampling parameters allow it (``speculates``)."""
    return not request.prefill_only and speculates(request.params)


def speculates(params: SamplingParams) -> bool:
    """Whether a request with ``params`` may speculate (see the module docstring)."""
    return not (params.penalized or params.structured is not None or params.stop
                or params.logprobs is not None)


def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified chunk emits: ``sampled[i]`` is the token drawn after the
    chunk's ``i``-th token (its last token, then each draft); drafts are kept while they
    equal what was drawn in their place, and the first draw that differs, or the one
    after the last draft, ends the list."""
    out = []
    for i, token in enumerate(sampled):
        out.append(token)
        if i >= len(drafts) or token != drafts[i]:
            break
    return out


def sampling_rows(chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]
                  ) -> tuple[list[Request], list[int]]:
    """The request of each sampling row of a step's logits, in order, and the position of
    the token it draws: one row per sampling chunk, ``1 + num_draft_tokens`` for a
    speculated one."""
    rows: list[Request] = []
    positions: list[int] = []
    for chunk in chunks:
        if chunk.sample:
            request = requests[chunk.request_id]
            first = chunk.start_position + len(chunk.token_ids) - chunk.num_draft_tokens
            for i in range(chunk.num_draft_tokens + 1):
                rows.append(request)
                positions.append(first + i)
    return rows, positions


def per_chunk(token_ids: Sequence[int], chunks: Sequence[ScheduledChunk]
              ) -> list[int | tuple[int, ...]]:
    """The tokens drawn for ``sampling_rows`` regrouped: one per sampling chunk, a tuple
    of ``1 + num_draft_tokens`` for a speculated one (``Scheduler.update`` takes them)."""
    drawn = iter(token_ids)
    out: list[int | tuple[int, ...]] = []
    for chunk in chunks:
        if chunk.sample:
            if chunk.num_draft_tokens:
                out.append(tuple(next(drawn) for _ in range(chunk.num_draft_tokens + 1)))
            else:
                out.append(next(drawn))
    return out
