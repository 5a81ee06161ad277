"""Structured outputs in one engine: a matcher per constrained request (``engine.grammar``),
its mask applied to the request's logits before sampling, the sampled token followed
after. A request's matcher follows its whole output, wherever each token was sampled:
opened over a resumed request's resumed tokens, advanced over the first token that came
with the KV (``EngineCore.admit_with_kv``) and over every token sampled here. A request
whose grammar is complete (no token may follow) stops (``FinishReason.STOP``).

The masks of the next step are made ahead where a core is free of torch's threads: once
a step's tokens are followed, every live matcher's next mask is made on the mask thread
(``engine.core.masks``) while the engine thread hands the tokens out, schedules and runs
the next forward; the next step's ``mask`` takes them (and makes now only those of
requests that were not live then). A matcher is never touched by the engine thread
while its mask is being made: everything that changes one waits for the masks first
(``settle``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import llguidance
import torch

from engine.core.masks import MaskMaker, PendingMasks, apply_token_bitmask
from engine.core.request import Request
from engine.grammar import Grammars, advance

log = logging.getLogger(__name__)


class Constraints:
    """The matchers of one engine's constrained requests, by request id."""

    def __init__(self, make_grammars: Callable[[], Grammars] | None, *,
                 masks_ahead: bool | None = None) -> None:
        """``make_grammars``: builds the compiler on the first constrained request (None:
        this engine has no tokenizer, structured outputs are refused). ``masks_ahead``:
        whether the masks are made ahead on a thread (None: where a core is free)."""
        self._masks_ahead = masks_ahead
        self._make_grammars = make_grammars
        self._grammars: Grammars | None = None
        self._unavailable = "" if make_grammars is not None else "this engine has no tokenizer"
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._done: set[str] = set()  # matchers that let no token come (complete or broken)
        self._maker: MaskMaker | None = None  # its thread starts with the first matcher
        self._pending: PendingMasks | None = None  # the next step's masks, being made
        self._stale: set[str] = set()  # requests whose mask there is out of date
        # engine-thread seconds the steps spent on the masks (waited for, made, applied)
        # and on following the sampled tokens: what they cost the steps (bench.sampling)
        self.mask_seconds = 0.0
        self.follow_seconds = 0.0

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

    @property
    def _masks(self) -> MaskMaker:
        if self._maker is None:
            grammars = self.grammars
            assert grammars is not None  # a matcher exists: the compiler was built
            self._maker = MaskMaker(grammars.vocab_size, ahead=self._masks_ahead)
        return self._maker

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
        matcher = grammars.matcher(structured)  # a new one: no mask of it is being made
        resumed = request.prompt_token_ids[len(request.prompt_token_ids)
                                           - request.num_resumed_tokens:]
        if not advance(matcher, resumed):
            raise ValueError(f"the resumed tokens do not match the structured output: "
                             f"{matcher.get_error()[:200]}")
        self._matchers[request.request_id] = matcher
        self._stale.add(request.request_id)
        self._note_done(request.request_id, matcher)

    def follow(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's next output tokens (a rejected one is logged: its matcher is then
        done, and the request stops)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        self._wait()  # its mask may be being made
        if not advance(matcher, token_ids):
            log.warning("request %s: token %s breaks its structured output: %s", request_id,
                        list(token_ids), matcher.get_error()[:200])
        self._stale.add(request_id)
        self._note_done(request_id, matcher)

    def follow_step(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """A step's sampled tokens (``token_ids[i]``: request ``request_ids[i]``'s); then the
        next step's masks are started."""
        matchers = self._matchers
        rows = [(rid, matchers[rid], t) for rid, t in zip(request_ids, token_ids, strict=True)
                if rid in matchers]
        if not rows:
            return
        started = time.perf_counter()
        self._wait()
        for request_id, matcher, token_id in rows:  # follow(), without its per-row calls
            if not matcher.consume_token(token_id):
                log.warning("request %s: token %s breaks its structured output: %s",
                            request_id, token_id, matcher.get_error()[:200])
            if matcher.is_stopped() or matcher.is_error():
                self._done.add(request_id)
        self._stale.update(rid for rid, _, _ in rows)
        self.follow_seconds += time.perf_counter() - started
        started = time.perf_counter()
        self._make_next()
        self.mask_seconds += time.perf_counter() - started

    def is_done(self, request_id: str) -> bool:
        """Whether the request's grammar lets no more tokens come (complete, or broken)."""
        return request_id in self._done

    def close(self, request_id: str) -> None:
        """Stops following the request (a mask of it being made is left unused)."""
        self._matchers.pop(request_id, None)
        self._done.discard(request_id)
        self._stale.discard(request_id)

    def mask(self, logits: torch.Tensor, request_ids: Sequence[str], *,
             in_place: bool = False) -> torch.Tensor:
        """``logits`` (row ``i``: request ``request_ids[i]``) with every token a row's grammar
        does not allow at -inf: a copy, or (``in_place``, fp32 logits) ``logits`` itself,
        changed; ``logits`` unchanged when no row is constrained. The masks made ahead are
        used; those missing are made now."""
        rows = [(i, rid) for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return logits
        started = time.perf_counter()
        try:
            return self._mask(logits, rows, in_place)
        finally:
            self.mask_seconds += time.perf_counter() - started

    def _mask(self, logits: torch.Tensor, rows: list[tuple[int, str]],
              in_place: bool) -> torch.Tensor:
        pending, self._pending = self._pending, None
        ahead: dict[str, int] = {}
        if pending is not None:
            pending.wait()
            ahead = {rid: j for j, rid in enumerate(pending.request_ids)
                     if rid not in self._stale}
        missing = [k for k, (_, rid) in enumerate(rows) if rid not in ahead]
        if pending is not None and not missing:  # all made ahead
            picks = [ahead[rid] for _, rid in rows]
            bitmask = (pending.bitmask if picks == list(range(len(pending.request_ids)))
                       else pending.bitmask[torch.tensor(picks)])
        else:
            now = self._masks.start(tuple(rows[k][1] for k in missing),
                                    [self._matchers[rows[k][1]] for k in missing])
            now.wait()
            made = [k for k in range(len(rows)) if rows[k][1] in ahead]
            if not made:  # all made now
                bitmask = now.bitmask
            else:
                assert pending is not None
                bitmask = torch.empty(len(rows), self._masks.words, dtype=torch.int32)
                bitmask[torch.tensor(missing)] = now.bitmask
                bitmask[torch.tensor(made)] = pending.bitmask[
                    torch.tensor([ahead[rows[k][1]] for k in made])]
        out = logits.float() if in_place else logits.float().clone()
        apply_token_bitmask(out, bitmask, [i for i, _ in rows])
        return out

    def settle(self) -> None:
        """Waits for the masks being made and drops them; after it no thread but the
        caller's reads a matcher."""
        self._wait()
        self._pending = None

    def _wait(self) -> None:
        """Waits for the masks being made (kept for the next step: a matcher changed now
        is marked stale)."""
        if self._pending is not None:
            self._pending.wait(raise_errors=False)

    def shutdown(self) -> None:
        """Stops the mask thread (after the masks being made)."""
        self.settle()
        if self._maker is not None:
            self._maker.shutdown()

    def _make_next(self) -> None:
        """Starts making the next mask of every matcher that lets tokens come (where masks
        are made ahead: otherwise the next step makes those it needs)."""
        self.settle()
        if not self._masks.ahead:
            return
        live = [(rid, m) for rid, m in self._matchers.items() if rid not in self._done]
        self._stale.clear()
        if live:
            self._pending = self._masks.start(tuple(rid for rid, _ in live),
                                              [m for _, m in live])

    def _note_done(self, request_id: str, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_stopped() or matcher.is_error():
            self._done.add(request_id)
