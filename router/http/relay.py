"""One HTTP request from ``RouterCore.start`` to its last byte: an ASGI response.

``Relay`` is returned by the endpoints once the body is parsed. When uvicorn runs it, it
starts the served and relays its chunks, while a second task waits for the client to
disconnect. Whichever ends first cancels the other, so a client that leaves — while queued,
before the first token, mid-stream, or waiting for a non-streamed response — cancels the
relay, whose ``aclosing(served.chunks())`` then cancels the request on every worker and
leaves admission at once (as a gRPC cancel does in ``router.service``).

The response status is chosen as late as possible: headers go out with the first chunk,
so anything that fails before it (refused at admission, invalid, no worker, deadline
passed in the queue) is a plain HTTP error with its status; a non-streamed response is
sent only when complete, so its errors always are. An error after a stream started is an
SSE ``error`` event (OpenAI's error body) followed by ``data: [DONE]``.

Resumable streams (``router.resume``): every event that carries output has an SSE ``id``,
``OFFSET.TOKEN`` — the tokens sent so far and the resume token after them (base64url) —
so a client whose stream broke sends the same request again with ``Last-Event-ID`` and
the token ids it received (``resume_token_ids``; ``return_token_ids`` puts them in the
chunks), and gets the rest.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.errors import RouteError
from router.http.errors import ApiError, as_api_error
from router.http.logprobs import LogprobsWriter
from router.http.responses import DONE, Shape, sse
from router.outputs import OutputChunk
from router.resume import ResumeSeal
from router.validation import ClientRequest, InvalidRequest, ValidRequest

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class StartedRequest(Protocol):
    """What the relay needs of ``router.served.ServedRequest``."""

    @property
    def request_id(self) -> str: ...

    @property
    def request(self) -> ValidRequest: ...

    def chunks(self) -> AsyncGenerator[OutputChunk, None]: ...


class RequestStarter(Protocol):
    """What the relay needs of ``router.core.RouterCore``."""

    @property
    def seal(self) -> ResumeSeal: ...

    async def start(self, client: ClientRequest,
                    timeout_s: float | None) -> StartedRequest: ...


def event_id(offset: int, token: bytes) -> str:
    """The SSE ``id`` of an event after ``offset`` tokens: ``OFFSET.TOKEN`` (base64url)."""
    return f"{offset}.{base64.urlsafe_b64encode(token).decode().rstrip('=')}"


def parse_event_id(value: str) -> tuple[int, bytes]:
    """(offset, resume token) of a ``Last-Event-ID``; ``ApiError`` (400) if malformed."""
    offset, _, token = value.strip().partition(".")
    try:
        return int(offset), base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (ValueError, binascii.Error):
        raise ApiError.invalid("Last-Event-ID must be the id of an event of the stream "
                               "(OFFSET.TOKEN)", "Last-Event-ID") from None


async def send_json(send: Send, status: int, body: dict[str, Any],
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class Relay(Response):
    """Runs ``client`` through ``core`` and writes the result (see module doc)."""

    def __init__(self, core: RequestStarter, client: ClientRequest, *,
                 timeout_s: float | None, chat: bool, model: str, stream: bool,
                 include_usage: bool, token_ids: bool = False,
                 logprobs: LogprobsWriter | None = None, echo: str | None = None,
                 prompt_logprobs: LogprobsWriter | None = None) -> None:
        """``echo``: the prompt's text, to lead each choice's (completions); its
        ``prompt_logprobs``: vLLM's field was asked for."""
        super().__init__()
        self._core = core
        self._client = client
        self._timeout_s = timeout_s
        self._chat, self._model, self._stream = chat, model, stream
        self._include_usage = include_usage
        self._token_ids = token_ids
        self._logprobs = logprobs
        self._echo = echo
        self._prompt_logprobs = prompt_logprobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._run(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
        if work.done() and not work.cancelled() and work.exception() is not None:
            logger.error("writing the response failed", exc_info=work.exception())

    async def _run(self, send: Send) -> None:
        try:
            served = await self._core.start(self._client, self._timeout_s)
        except Exception as exc:  # refused before any work: a plain HTTP error
            error = as_api_error(exc)
            if isinstance(exc, RouteError | InvalidRequest):
                logger.info("refused: %d %s", error.status, error.message)
            else:
                logger.exception("start failed unexpectedly")
            await send_json(send, error.status, error.body())
            return
        rid = served.request_id
        if self._logprobs is not None and served.request.resumed:  # text offsets go on
            self._logprobs.resume_after((*served.request.prompt_token_ids,
                                         *served.request.resumed)
                                        if self._echo is not None else served.request.resumed)
        shape = Shape.of(chat=self._chat, request_id=rid, model=self._model,
                         created=int(time.time()), include_usage=self._include_usage,
                         token_ids=self._token_ids, logprobs=self._logprobs,
                         n=served.request.n,
                         # a resumed stream's client has had the echo
                         echo=None if served.request.resumed else self._echo,
                         prompt_token_ids=served.request.prompt_token_ids,
                         prompt_logprobs=self._prompt_logprobs)
        headers = [(REQUEST_ID_HEADER.encode(), rid.encode())]
        log = logging.LoggerAdapter(logger, {"request_id": rid})
        started = time.monotonic()
        try:
            await self._relay(send, served, shape, headers, log)
        except asyncio.CancelledError:
            log.info("cancelled after %.2fs (the client left, or the router stopped)",
                     time.monotonic() - started)
            raise

    async def _relay(self, send: Send, served: StartedRequest, shape: Shape,
                     headers: list[tuple[bytes, bytes]],
                     log: logging.LoggerAdapter[logging.Logger]) -> None:
        async with aclosing(served.chunks()) as chunks:
            try:
                first = await anext(chunks, None)  # the status waits for the first chunk
            except Exception as exc:  # nothing sent yet: a plain HTTP error
                error = _failed(log, exc)
                await send_json(send, error.status, error.body(), headers)
                return
            if self._stream:
                await self._write_stream(send, served, shape, first, chunks, headers, log)
            else:
                await self._write_whole(send, shape, first, chunks, headers, log)

    async def _write_stream(self, send: Send, served: StartedRequest, shape: Shape,
                            first: OutputChunk | None,
                            chunks: AsyncIterator[OutputChunk],
                            headers: list[tuple[bytes, bytes]],
                            log: logging.LoggerAdapter[logging.Logger]) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_SSE_HEADERS, *headers]})

        async def write(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        cursor = self._core.seal.cursor(served.request, served.request.resumed)

        def encoded(chunk: OutputChunk) -> bytes:
            """The chunk's events, the last with the id that resumes after it."""
            events = shape.chunks(chunk)
            after: str | None = None
            if served.request.n == 1:  # n > 1 choices: a stream not to resume (no ids)
                after = event_id(cursor.offset + len(chunk.token_ids),
                                 cursor.advance(chunk.token_ids))
            if chunk.finish_reason is not None:  # whole: nothing to resume after it
                after = None
            return b"".join(sse(e, event_id=after if i == len(events) - 1 else None)
                            for i, e in enumerate(events))

        # a resumed stream's client has had the opening (a chat's role chunk) already
        opening = b"" if served.request.resumed else b"".join(sse(e) for e in shape.opening())
        await write(opening + (encoded(first) if first is not None else b""))
        last = first
        try:
            async for chunk in chunks:
                data = encoded(chunk)
                if data:
                    await write(data)
                last = chunk
        except Exception as exc:
            await write(sse(_failed(log, exc).body(), event="error"))
        else:
            usage = last.usage if last is not None else None
            await write(b"".join(sse(e) for e in shape.closing(usage)))
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    async def _write_whole(self, send: Send, shape: Shape, first: OutputChunk | None,
                           chunks: AsyncIterator[OutputChunk],
                           headers: list[tuple[bytes, bytes]],
                           log: logging.LoggerAdapter[logging.Logger]) -> None:
        received = [first] if first is not None else []
        try:
            received += [chunk async for chunk in chunks]
        except Exception as exc:
            error = _failed(log, exc)
            await send_json(send, error.status, error.body(), headers)
            return
        await send_json(send, 200, shape.whole(received), headers)


def _failed(log: logging.LoggerAdapter[logging.Logger], exc: Exception) -> ApiError:
    """The error a failure becomes, logged (unexpected ones with their traceback)."""
    error = as_api_error(exc)
    if isinstance(exc, RouteError | ApiError | InvalidRequest):
        log.warning("failed: %d %s", error.status, error.message)
    else:
        log.exception("failed unexpectedly")
    return error


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the body was read before the relay started)."""
    while (await receive())["type"] != "http.disconnect":
        pass
