"""How one step's tokens are chosen from the model's logits: the logits processors of each
request's history (``engine.core.logits``), its structured output's mask
(``engine.core.constrain``), the sampler (``engine.core.sampler``), then the logprobs asked
for, of the raw logits (``engine.core.logprobs``). The engine core calls it once a step."""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.core.constrain import Constraints
from engine.core.logits import History, process_logits
from engine.core.logprobs import token_logprobs
from engine.core.request import Request
from engine.core.sampler import sample
from engine.sampling_params import TokenLogprobs

HistoryCache = weakref.WeakKeyDictionary[Request, "_Tracked"]


@dataclass
class Choice:
    """A step's tokens, one per sampled row, and the logprobs of the rows that asked."""

    token_ids: list[int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # by request id


def choose_tokens(logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int],
                  histories: HistoryCache, constraints: Constraints) -> Choice:
    """Row ``i`` of ``logits`` is ``requests[i]``'s next token, at ``positions[i]``; the
    constrained requests' matchers follow the tokens chosen."""
    params = [r.params for r in requests]
    raw = logits
    in_place = all(p.logprobs is None for p in params)  # the raw logits kept for logprobs
    if any(p.penalized for p in params):
        logits = process_logits(logits, params,
                                [_history(r, histories) if p.penalized else _NO_HISTORY
                                 for r, p in zip(requests, params, strict=True)],
                                in_place=in_place)
        in_place = True  # a copy already, or the raw logits are not needed
    ids = [r.request_id for r in requests]
    logits = constraints.mask(logits, ids, in_place=in_place)
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


class _Tracked:
    """What the logits processors read of one request, kept as C int arrays (the compiled
    penalties read them where they lie) and grown by the new output tokens each step."""

    def __init__(self, request: Request) -> None:
        prompt = request.prompt_token_ids
        split = len(prompt) - request.num_resumed_tokens
        # the distinct ids of the client's prompt (the repetition penalty's only)
        self.prompt_ids = (array("i", sorted(set(prompt[:split])))
                           if request.params.repetition_penalty != 1.0 else array("i"))
        self.resumed = array("i", prompt[split:])  # the resumed tokens are output too
        self.output_ids = array("i", self.resumed)
        self.seen = 0  # output tokens copied so far

    def output(self, request: Request) -> array[int]:
        produced = request.output_token_ids
        if len(produced) < self.seen:  # never expected: start the copy again
            self.output_ids, self.seen = array("i", self.resumed), 0
        self.output_ids.extend(produced[self.seen:])
        self.seen = len(produced)
        return self.output_ids


def _history(request: Request, histories: HistoryCache) -> History:
    """The tokens the logits processors (``engine.core.logits``) read of ``request``;
    ``histories`` keeps each request's copy (made once, grown each step, gone with it)."""
    tracked = histories.get(request)
    if tracked is None:
        tracked = histories[request] = _Tracked(request)
    eos = () if request.params.ignore_eos else request.eos_token_ids
    return History(tracked.prompt_ids, tracked.output(request), eos)
