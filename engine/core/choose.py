"""How one step's tokens are chosen from the model's logits: the logits processors of each
request's history (``engine.core.logits``), its structured output's mask
(``engine.core.constrain``), the sampler (``engine.core.sampler``), then the logprobs asked
for, of the raw logits (``engine.core.logprobs``). The engine core calls it once a step."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.core.constrain import Constraints
from engine.core.logits import History, process_logits
from engine.core.logprobs import token_logprobs
from engine.core.request import Request
from engine.core.sampler import sample
from engine.sampling_params import TokenLogprobs

PromptCache = weakref.WeakKeyDictionary[Request, torch.Tensor]


@dataclass
class Choice:
    """A step's tokens, one per sampled row, and the logprobs of the rows that asked."""

    token_ids: list[int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # by request id


def choose_tokens(logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int],
                  prompts: PromptCache, constraints: Constraints) -> Choice:
    """Row ``i`` of ``logits`` is ``requests[i]``'s next token, at ``positions[i]``; the
    constrained requests' matchers follow the tokens chosen."""
    params = [r.params for r in requests]
    raw = logits
    if any(p.penalized for p in params):  # the raw logits kept only for logprobs
        logits = process_logits(logits, params,
                                [_history(r, prompts) if p.penalized else _NO_HISTORY
                                 for r, p in zip(requests, params, strict=True)],
                                in_place=all(p.logprobs is None for p in params))
    ids = [r.request_id for r in requests]
    logits = constraints.mask(logits, ids)
    sampled = sample(logits, params, positions)
    constraints.follow_step(ids, sampled)
    choice = Choice(sampled)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if rows:
        picked = raw[torch.tensor(rows, device=raw.device)] if len(rows) < len(params) else raw
        found = token_logprobs(picked, [sampled[i] for i in rows],
                               [params[i].logprobs or 0 for i in rows])
        choice.logprobs = {ids[i]: lp for i, lp in zip(rows, found, strict=True)}
    return choice


_NO_HISTORY = History((), ())  # an unpenalized row's: never read


def _history(request: Request, prompts: PromptCache) -> History:
    """The tokens the logits processors (``engine.core.logits``) read of ``request``;
    ``prompts`` keeps each request's distinct prompt ids (made once, gone with it)."""
    prompt = request.prompt_token_ids
    split = len(prompt) - request.num_resumed_tokens
    eos = () if request.params.ignore_eos else request.eos_token_ids
    prompt_ids: Sequence[int] | torch.Tensor = ()
    if request.params.repetition_penalty != 1.0:
        prompt_ids = prompts.get(request)  # type: ignore[assignment]
        if prompt_ids is None:
            prompt_ids = prompts[request] = torch.unique(torch.tensor(prompt[:split]))
    output = request.output_token_ids  # the resumed tokens are output too
    return History(prompt_ids, [*prompt[split:], *output] if split < len(prompt) else output,
                   eos)


