"""OpenAI's ``logprobs`` objects, built from the router's ``TokenLogprobs``.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}`` (``top_logprobs`` as many as asked, 0..20);
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...],
  "text_offset"}``, the legacy shape, ``top_logprobs`` holding the sampled token too (as
  vLLM does); ``text_offset`` counts characters of the tokens' own strings from the start
  of the completion. With ``echo`` the prompt's tokens lead, the first with ``null``s
  (nothing comes before it), and the offsets count from the prompt's start;
- vLLM's ``prompt_logprobs``: ``[null, {"ID": {"logprob", "rank", "decoded_token"}, ...},
  ...]``, one per prompt token, the token itself and its likeliest alternatives.

A token's string is the tokenizer's decoding of that one id (so a token that holds part
of a multi-byte character reads as U+FFFD, as in vLLM); ``bytes`` are its UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers

from engine.sampling_params import TokenLogprobs


class LogprobsWriter:
    """Writes one request's ``logprobs`` objects, chunk by chunk (it keeps the completion's
    text offset between chunks)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat: bool) -> None:
        self._tokenizer = tokenizer
        self._chat = chat
        self._offsets: dict[int, int] = {}  # by choice

    def body(self, found: Sequence[TokenLogprobs], index: int = 0,
             echoed: Sequence[int | TokenLogprobs] = ()) -> dict[str, Any]:
        """The ``logprobs`` object of choice ``index``'s tokens ``found`` (all of them, or
        a stream chunk's: the text offsets go on from the choice's previous chunk), led
        (completions' ``echo``) by the prompt's ``echoed``: its first token's id, then
        the logprobs of the others."""
        if self._chat:
            return {"content": [self._chat_entry(lp) for lp in found]}
        entries = [*echoed, *found]
        tokens = [self._text(e if isinstance(e, int) else e.token_id) for e in entries]
        offsets, offset = [], self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {"tokens": tokens,
                "token_logprobs": [None if isinstance(e, int) else e.logprob for e in entries],
                "top_logprobs": [None if isinstance(e, int) else
                                 {**{self._text(t): v for t, v in e.top},
                                  self._text(e.token_id): e.logprob} for e in entries],
                "text_offset": offsets}

    def resume_after(self, token_ids: Sequence[int], index: int = 0) -> None:
        """Choice ``index``'s client has ``token_ids`` already (a resumed stream): its
        text offsets go on after theirs."""
        self._offsets[index] = self._offsets.get(index, 0) + sum(
            len(self._text(t)) for t in token_ids)

    def prompt_logprobs(self, found: Sequence[TokenLogprobs]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` of a prompt whose tokens after the first are
        ``found``."""
        out: list[dict[str, Any] | None] = [None]
        for lp in found:
            entry = {str(t): {"logprob": v, "rank": rank, "decoded_token": self._text(t)}
                     for rank, (t, v) in enumerate(lp.top, start=1)}
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank,
                                       "decoded_token": self._text(lp.token_id)}
            out.append(entry)
        return out

    def _chat_entry(self, found: TokenLogprobs) -> dict[str, Any]:
        return {**self._token(found.token_id, found.logprob),
                "top_logprobs": [self._token(t, v) for t, v in found.top]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
