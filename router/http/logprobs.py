"""OpenAI's ``logprobs`` objects, built from the router's ``TokenLogprobs``.

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}`` (``top_logprobs`` as many as asked, 0..20);
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...],
  "text_offset"}``, the legacy shape, ``top_logprobs`` holding the sampled token too (as
  vLLM does); ``text_offset`` counts characters of the tokens' own strings from the start
  of the completion.

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

    def body(self, found: Sequence[TokenLogprobs], index: int = 0) -> dict[str, Any]:
        """The ``logprobs`` object of choice ``index``'s tokens ``found`` (all of them, or
        a stream chunk's: the text offsets go on from the choice's previous chunk)."""
        if self._chat:
            return {"content": [self._chat_entry(lp) for lp in found]}
        tokens = [self._text(lp.token_id) for lp in found]
        offsets, offset = [], self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in found],
                "top_logprobs": [{**{self._text(t): v for t, v in lp.top},
                                  self._text(lp.token_id): lp.logprob} for lp in found],
                "text_offset": offsets}

    def _chat_entry(self, found: TokenLogprobs) -> dict[str, Any]:
        return {**self._token(found.token_id, found.logprob),
                "top_logprobs": [self._token(t, v) for t, v in found.top]}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
