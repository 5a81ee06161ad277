"""The FastAPI application of the HTTP API (``build_app``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (API
key required when the router has one: ``Authorization: Bearer KEY``, compared in constant
time, never logged), and, open to all, ``GET /health`` (200 while the router's gRPC health
says SERVING, else 503), ``GET /version``, ``GET /metrics`` (the router's Prometheus
metrics). Bodies are read by the endpoints themselves, bounded by the router's max message
bytes (413 past it), and parsed by ``router.http.protocol``; the requests then run in a
``router.http.relay.Relay``. Every error, routing ones included, has OpenAI's body.

Deadline: ``X-Request-Timeout: SECONDS`` in the request, else the router's default.
Request id: the body's ``request_id`` or an ``X-Request-Id`` header, else a fresh one;
it is sent back in ``X-Request-Id`` and in the response ``id``.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tokenizers
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from router.core import MAX_TIMEOUT_S, TOKENIZE_IN_THREAD_CHARS, RouterCore
from router.errors import RouteError
from router.http.chat_template import ChatTemplate
from router.http.errors import ApiError
from router.http.logprobs import LogprobsWriter
from router.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest, parse
from router.http.relay import REQUEST_ID_HEADER, Relay, parse_event_id
from router.validation import REQUEST_ID_RE, ClientRequest, InvalidRequest, check_vocab

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-request-timeout"
MAX_CHAT_MESSAGES = 4096  # messages of one chat request (each is rendered by the template)


@dataclass(frozen=True)
class HttpApi:
    """What the HTTP API serves and with what (the ``Router`` builds it)."""

    core: RouterCore
    tokenizer: tokenizers.Tokenizer  # for chat prompts (rendered text, no special tokens)
    serving: Callable[[], bool]  # the router's health: SERVING or not
    chat_template: ChatTemplate | None = None  # None: chat requests get a 400
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 4 << 20
    version: str = "0"
    created: int = 0  # Unix seconds the model has been served since (/v1/models)


def build_app(api: HttpApi) -> FastAPI:
    """The application; every route's contract is in the module doc."""
    app = FastAPI(title="pdserve", version=api.version, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.api = api
    _add_error_handlers(app)
    _add_open_routes(app, api)
    expected = f"Bearer {api.api_key}".encode() if api.api_key else None

    def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        limits = api.core.limits
        return {"object": "list", "data": [{
            "id": limits.name, "object": "model", "created": api.created,
            "owned_by": "pdserve", "root": limits.name, "parent": None,
            "max_model_len": limits.context_length}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body = parse(CompletionRequest, await _read_body(request, api.max_body_bytes))
        _check_common(body, api)
        text, token_ids = body.prompt_parts()
        client = body.client_request(request_id=_request_id(body, request),
                                     max_tokens=body.max_tokens, text=text, token_ids=token_ids)
        echo = None
        if body.echo:
            echo = text if text is not None else _echoed(api, list(token_ids or ()))
        return _relay(api, request, body, client, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body = parse(ChatCompletionRequest, await _read_body(request, api.max_body_bytes))
        _check_common(body, api)
        # the cheap checks first (draining, deadline, budgets): the template comes after
        api.core.gate(body.token_bound(api.core.limits.context_length), _timeout(request))
        token_ids = await _chat_prompt(api, body)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = _room_left(api.core, len(token_ids))
        client = body.client_request(request_id=_request_id(body, request),
                                     max_tokens=max_tokens, token_ids=token_ids)
        return _relay(api, request, body, client, chat=True)

    return app


def _add_open_routes(app: FastAPI, api: HttpApi) -> None:
    @app.get("/health")
    async def health() -> Response:
        serving = api.serving()
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"},
                            status_code=200 if serving else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": api.version}

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = api.core.metrics.render()
        return Response(data, media_type=content_type)


def _echoed(api: HttpApi, token_ids: list[int]) -> str:
    """A token-id prompt's text for ``echo`` (ids outside the vocabulary: 400, as the
    request would get; a prompt past the context is refused later, not decoded)."""
    limits = api.core.limits
    if len(token_ids) >= limits.context_length:
        return ""
    check_vocab("prompt token id", token_ids, limits.vocab_size)
    return str(api.tokenizer.decode(token_ids, skip_special_tokens=False))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> Response:  # a bug: OpenAI's shape
        log.exception("the HTTP API failed on %s", request.url.path)
        error = ApiError(500, f"the server failed: {type(exc).__name__}", code="internal")
        given = request.headers.get(REQUEST_ID_HEADER, "")  # echoed, as on every answer
        headers = {REQUEST_ID_HEADER: given} if REQUEST_ID_RE.fullmatch(given) else None
        return JSONResponse(error.body(), status_code=500, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RouteError)
    async def refused(request: Request, exc: RouteError) -> Response:  # e.g. the chat gate
        error = ApiError.from_route_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(InvalidRequest)
    async def invalid(request: Request, exc: InvalidRequest) -> Response:
        return JSONResponse(ApiError.from_invalid(exc).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = ApiError(exc.status_code, str(exc.detail), code=None)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def request_invalid(request: Request, exc: RequestValidationError) -> Response:
        return JSONResponse(ApiError.invalid(str(exc)).body(), status_code=400)


def _relay(api: HttpApi, request: Request, body: SamplingRequest, client: Any,
           *, chat: bool, echo: str | None = None) -> Relay:
    return Relay(api.core, _resumed(request, body, client), timeout_s=_timeout(request),
                 chat=chat, model=api.core.limits.name, stream=body.stream,
                 include_usage=body.include_usage, token_ids=body.return_token_ids,
                 logprobs=None if client.logprobs is None
                 else LogprobsWriter(api.tokenizer, chat=chat), echo=echo,
                 prompt_logprobs=None if body.prompt_logprobs_asked() is None
                 else LogprobsWriter(api.tokenizer, chat=chat))


def _resumed(request: Request, body: SamplingRequest, client: ClientRequest) -> ClientRequest:
    """``client``, resuming the stream ``Last-Event-ID`` names when there is one (with the
    body's ``resume_token_ids``, every token id received; ``router.http.relay``)."""
    last = request.headers.get("last-event-id")
    if last is None:
        if body.resume_token_ids is not None:
            raise ApiError.invalid("resume_token_ids needs the Last-Event-ID header of the "
                                   "stream to resume", "resume_token_ids")
        return client
    offset, token = parse_event_id(last)
    ids = tuple(body.resume_token_ids or ())
    if offset != len(ids):
        raise ApiError.invalid(f"Last-Event-ID is after {offset} tokens; resume_token_ids "
                               f"holds {len(ids)}", "resume_token_ids")
    return dataclasses.replace(client, resume_token=token, resume_token_ids=ids)


def _check_common(body: SamplingRequest, api: HttpApi) -> None:
    body.check_extras()
    served = api.core.limits.name
    if body.model and body.model != served:
        raise ApiError(404, f"the model {body.model!r} does not exist; this cluster serves "
                            f"{served!r}", param="model", code="model_not_found")


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body; 413 past ``limit`` bytes (announced or sent)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(size, limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body of {size} bytes is over the router's limit of {limit} "
                         "bytes", code="request_too_large")


def _timeout(request: Request) -> float | None:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TIMEOUT_S:
        raise ApiError.invalid(f"{TIMEOUT_HEADER} must be a number of seconds in (0, "
                               f"{MAX_TIMEOUT_S:g}] (24 hours), got {value[:40]!r}",
                               TIMEOUT_HEADER)
    return seconds


def _request_id(body: SamplingRequest, request: Request) -> str:
    return body.request_id or request.headers.get(REQUEST_ID_HEADER) or ""


async def _chat_prompt(api: HttpApi, body: ChatCompletionRequest) -> tuple[int, ...]:
    """The conversation rendered with the chat template and tokenized without adding
    special tokens (the template places them, as in ``transformers``)."""
    if api.chat_template is None:
        raise ApiError.invalid("this model has no chat template, so it serves /v1/completions "
                               "only; start the router with --chat-template FILE to serve "
                               "chat", "messages", code="no_chat_template")
    if len(body.messages) > MAX_CHAT_MESSAGES:
        raise ApiError.invalid(f"at most {MAX_CHAT_MESSAGES} messages are allowed, got "
                               f"{len(body.messages)}", "messages")
    limit = 64 * api.core.limits.context_length  # as router.validation bounds text
    if body.content_chars() > limit:  # before rendering: the template only adds to it
        raise ApiError.invalid(f"the conversation of {body.content_chars()} characters cannot "
                               f"fit the context length of {limit // 64} tokens", "messages")
    template = api.chat_template

    def render_and_encode() -> tuple[int, ...]:
        text = template.render(body.template_messages(),
                               add_generation_prompt=body.add_generation_prompt,
                               extra=body.chat_template_kwargs)
        if len(text) > limit:
            raise ApiError.invalid(f"the rendered conversation of {len(text)} characters "
                                   f"cannot fit the context length of {limit // 64} tokens",
                                   "messages")
        return tuple(api.tokenizer.encode(text, add_special_tokens=False).ids)

    if body.content_chars() > TOKENIZE_IN_THREAD_CHARS or len(body.messages) > 16:
        return await api.core.run_text_work(render_and_encode)
    return render_and_encode()


def _room_left(core: RouterCore, num_prompt_tokens: int) -> int | None:
    """A chat request's default ``max_tokens``: up to the context length, within what the
    largest decode worker can hold (None when nothing is left: validation says why)."""
    room = core.limits.context_length - num_prompt_tokens
    layout, largest = core.pool.layout(), core.pool.max_decode_blocks()
    if layout is not None and largest:
        room = min(room, largest * layout.block_size - num_prompt_tokens)
    return room if room > 0 else None
