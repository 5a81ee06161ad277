"""OpenAI's response bodies and stream chunks, built from the router's ``OutputChunk``s.

One ``Shape`` per endpoint says how a request's output looks:

- completions: ``object`` ``text_completion``; a stream chunk per ``OutputChunk`` with
  ``choices[0].text``, the last one with its ``finish_reason``;
- chat: ``chat.completion`` / ``chat.completion.chunk``; a stream opens with the role
  (``delta: {"role": "assistant", "content": ""}``), then one content delta per
  ``OutputChunk``, then a chunk with an empty delta and the ``finish_reason``.

With ``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last
chunk with no choices carries the usage. With vLLM's ``return_token_ids`` each choice
also carries its ``token_ids`` (what a client needs to resume a broken stream). A request
that asked for logprobs gets each choice's (and each chunk's) ``logprobs`` object
(``router.http.logprobs``), else ``"logprobs": null``. ``usage`` is OpenAI's, with
``prompt_tokens_details.cached_tokens`` (prompt tokens served from a prefix cache).

Completions' ``echo``: each choice's text starts with the prompt (a stream's first chunk
of each choice carries it), and its logprobs, when asked, with the prompt's tokens. vLLM's
``prompt_logprobs`` (never streamed): on each completions choice, at the top of a chat
response.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import TokenLogprobs
from router.http.logprobs import LogprobsWriter
from router.outputs import OutputChunk, Usage

DONE = b"data: [DONE]\n\n"


def usage_body(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


# Line breaks to Python's str.splitlines (and clients whose SSE readers split with it,
# httpx's iter_lines among them) that JSON leaves unescaped: a token's text holding one
# would cut its event's data line in two. Escaped, the JSON decodes to the same text.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any], event: str | None = None, event_id: str | None = None) -> bytes:
    """One server-sent event (``event:`` and ``id:`` lines only when given); its data is
    one line to any line splitter (``_LINE_BREAKS``)."""
    head = (f"event: {event}\n" if event else "") + (f"id: {event_id}\n" if event_id else "")
    body = json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"{head}data: {body}\n\n".encode()


@dataclass(frozen=True)
class Shape:
    """How one request's output looks on the wire (see module doc)."""

    chat: bool
    response_id: str  # "cmpl-<request id>" / "chatcmpl-<request id>"
    model: str
    created: int  # Unix seconds
    include_usage: bool = False
    token_ids: bool = False  # vLLM's return_token_ids: each choice carries its token ids
    logprobs: LogprobsWriter | None = None  # the request asked for logprobs
    n: int = 1  # choices
    echo: str | None = None  # completions' echo: the prompt's text, leading each choice's
    prompt_token_ids: tuple[int, ...] = ()  # (for the echoed logprobs' first token)
    prompt_logprobs: LogprobsWriter | None = None  # vLLM's prompt_logprobs were asked for
    _echoed: set[int] = field(default_factory=set)  # choices whose stream had the echo

    @classmethod
    def of(cls, *, chat: bool, request_id: str, model: str, created: int,
           include_usage: bool = False, token_ids: bool = False,
           logprobs: LogprobsWriter | None = None, n: int = 1, echo: str | None = None,
           prompt_token_ids: tuple[int, ...] = (),
           prompt_logprobs: LogprobsWriter | None = None) -> Shape:
        prefix = "chatcmpl-" if chat else "cmpl-"
        return cls(chat, prefix + request_id, model, created, include_usage, token_ids,
                   logprobs, n, echo, prompt_token_ids, prompt_logprobs)

    def _logprobs(self, found: Sequence[TokenLogprobs], index: int = 0,
                  prompt: Sequence[TokenLogprobs] | None = None) -> dict[str, Any] | None:
        """The logprobs object of ``found``; led by the echoed prompt's when ``prompt``
        (its logprobs, from the choice's first chunk) is given."""
        if self.logprobs is None:
            return None
        echoed: tuple[int | TokenLogprobs, ...] = ()
        if prompt is not None and self.prompt_token_ids:
            echoed = (self.prompt_token_ids[0], *prompt)
        return self.logprobs.body(found, index, echoed)

    def _echo(self, index: int, chunk: OutputChunk | None = None) -> tuple[str, Any]:
        """(text, prompt logprobs) the choice's first output leads with (``echo``), once
        per choice in a stream (``chunk``; None: the whole response)."""
        if self.chat or self.echo is None or chunk is not None and index in self._echoed:
            return "", None
        if chunk is not None:
            self._echoed.add(index)
        return self.echo, chunk.prompt_logprobs if chunk is not None else None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created,
                "model": self.model}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before any output (chat: the role)."""
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]) for i in range(self.n)]

    def chunks(self, chunk: OutputChunk) -> list[dict[str, Any]]:
        """The stream chunks of one ``OutputChunk`` (none for an empty, unfinished one)."""
        out = []
        finish = chunk.finish_reason
        ids = {"token_ids": list(chunk.token_ids)} if self.token_ids else {}
        # tokens with no text yet (bytes held back) still carry their ids / logprobs
        tokens = bool(chunk.token_ids) and (bool(ids) or self.logprobs is not None)
        index = chunk.index
        if self.chat:
            if chunk.text or tokens:
                out.append(self._chunk([{"index": index, "delta": {"content": chunk.text},
                                         "logprobs": self._logprobs(chunk.logprobs, index),
                                         "finish_reason": None, **ids}]))
            if finish is not None:
                out.append(self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                         "finish_reason": finish}]))
        elif chunk.text or finish is not None or tokens or self.echo is not None:
            echo, prompt = self._echo(index, chunk)
            if chunk.text or finish is not None or tokens or echo:
                out.append(self._chunk([{"index": index, "text": echo + chunk.text,
                                         "logprobs": self._logprobs(chunk.logprobs, index,
                                                                    prompt),
                                         "finish_reason": finish, **ids}]))
        return out

    def closing(self, usage: Usage | None) -> list[dict[str, Any]]:
        """Chunks after the output: the usage chunk when it was asked for."""
        if not self.include_usage or usage is None:
            return []
        return [{**self._chunk([]), "usage": usage_body(usage)}]

    def whole(self, received: Sequence[OutputChunk]) -> dict[str, Any]:
        """The non-streamed response of every chunk ``received`` (each choice's chunks
        joined; the usage: the last chunk's)."""
        choices = [self._choice(i, [c for c in received if c.index == i])
                   for i in range(self.n)]
        usage = received[-1].usage if received else None
        body = {**self._head("chat.completion" if self.chat else "text_completion"),
                "choices": choices, "usage": usage_body(usage)}
        if self.chat and self.prompt_logprobs is not None:  # vLLM puts a chat's here
            body["prompt_logprobs"] = self.prompt_logprobs.prompt_logprobs(
                [lp for c in received if c.index == 0 for lp in c.prompt_logprobs])
        return body

    def _choice(self, index: int, chunks: Sequence[OutputChunk]) -> dict[str, Any]:
        text = "".join(c.text for c in chunks)
        finish_reason = chunks[-1].finish_reason if chunks else None
        ids = {"token_ids": [t for c in chunks for t in c.token_ids]} if self.token_ids else {}
        prompt_lps = [lp for c in chunks for lp in c.prompt_logprobs]
        echo, _ = self._echo(index)
        found = self._logprobs([lp for c in chunks for lp in c.logprobs], index,
                               prompt_lps if echo else None)
        if self.chat:
            return {"index": index, "logprobs": found,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish_reason, **ids}
        extra = {} if self.prompt_logprobs is None else {
            "prompt_logprobs": self.prompt_logprobs.prompt_logprobs(prompt_lps)}
        return {"index": index, "text": echo + text, "logprobs": found,
                "finish_reason": finish_reason, **ids, **extra}
