"""Structured outputs in one engine: a matcher per constrained request (``engine.grammar``),
its mask applied to the request's logits before sampling, the sampled token followed
after. A request's matcher follows its whole output, wherever each token was sampled:
opened over a resumed request's resumed tokens, advanced over the first token that came
with the KV (``EngineCore.admit_with_kv``) and over every token sampled here. A request
whose grammar is complete (no token may follow) stops (``FinishReason.STOP``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import llguidance
import llguidance.torch as llg_torch
import torch

from engine.core.request import Request
from engine.grammar import Grammars, advance

log = logging.getLogger(__name__)


class Constraints:
    """The matchers of one engine's constrained requests, by request id."""

    def __init__(self, make_grammars: Callable[[], Grammars] | None) -> None:
        """``make_grammars``: builds the compiler on the first constrained request (None:
        this engine has no tokenizer, structured outputs are refused)."""
        self._make_grammars = make_grammars
        self._grammars: Grammars | None = None
        self._unavailable = "" if make_grammars is not None else "this engine has no tokenizer"
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    @property
    def grammars(self) -> Grammars | None:
        """The compiler, built on first use (None, with ``_unavailable`` saying why, when
        it cannot be: e.g. a tokenizer llguidance cannot read)."""
        if self._grammars is None and not self._unavailable:
            assert self._make_grammars is not None
            try:
                self._grammars = self._make_grammars()
            except (ValueError, RuntimeError) as exc:
                self._unavailable = f"this model's tokenizer cannot be used: {exc}"
                log.warning("structured outputs are unavailable: %s", self._unavailable)
        return self._grammars

    def check(self, request: Request) -> None:
        """``ValueError`` (naming why) unless the request's structured output compiles."""
        structured = request.params.structured
        if structured is None:
            return
        grammars = self.grammars
        if grammars is None:
            raise ValueError(f"structured outputs are unavailable: {self._unavailable}")
        grammars.grammar(structured)

    def open(self, request: Request) -> None:
        """Starts following ``request`` (checked by ``check``): its resumed tokens are output
        the grammar has seen."""
        structured = request.params.structured
        grammars = self.grammars
        if structured is None or grammars is None:
            return
        matcher = grammars.matcher(structured)
        resumed = request.prompt_token_ids[len(request.prompt_token_ids)
                                           - request.num_resumed_tokens:]
        if not advance(matcher, resumed):
            raise ValueError(f"the resumed tokens do not match the structured output: "
                             f"{matcher.get_error()[:200]}")
        self._matchers[request.request_id] = matcher

    def follow(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's next output tokens (a rejected one is logged: its matcher is then
        done, and the request stops)."""
        matcher = self._matchers.get(request_id)
        if matcher is not None and not advance(matcher, token_ids):
            log.warning("request %s: token %s breaks its structured output: %s", request_id,
                        list(token_ids), matcher.get_error()[:200])

    def is_done(self, request_id: str) -> bool:
        """Whether the request's grammar lets no more tokens come (complete, or broken)."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and (matcher.is_stopped() or matcher.is_error())

    def close(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, request_ids: Sequence[str]) -> torch.Tensor:
        """``logits`` (row ``i``: request ``request_ids[i]``) with every token a row's grammar
        does not allow at -inf (a copy; ``logits`` itself when no row is constrained)."""
        rows = [(self._matchers[rid], i) for i, rid in enumerate(request_ids)
                if rid in self._matchers]
        if not rows:
            return logits
        bitmask = llg_torch.allocate_token_bitmask(len(logits), logits.shape[1])  # all allowed
        for matcher, row in rows:  # serial: threads would contend with torch's on the cores
            llg_torch.fill_next_token_bitmask(matcher, bitmask, row)
        out = logits.float().clone()  # the raw logits stay as they were (logprobs)
        llg_torch.apply_token_bitmask_inplace(out, bitmask.to(logits.device))
        return out

    def follow_step(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """A step's sampled tokens (``token_ids[i]``: request ``request_ids[i]``'s)."""
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            if request_id in self._matchers:
                self.follow(request_id, (token_id,))
