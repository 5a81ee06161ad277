"""The HTTP API's application (router.http.app, relay, responses, errors) over a fake
``RouterCore`` that validates with the router's real ``validate`` and streams scripted
chunks: response and stream shapes, the error mapping, auth, limits, and a client that
disconnects (the generation is closed at once, in every window)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from starlette.testclient import TestClient

from engine.text.tokenizer import load_tokenizer
from router.errors import RouteError
from router.http.app import HttpApi, build_app
from router.http.chat_template import load_chat_template
from router.metrics import RouterMetrics
from router.outputs import OutputChunk, Usage
from router.resume import ResumeSeal
from router.validation import ClientRequest, ModelLimits, ValidRequest, validate

KEY = "k3y-for-tests"
HOLD = "hold"  # a script item: wait forever (a token that does not come)
CHUNKS = [OutputChunk((5, 6), "Hel"), OutputChunk((7,), ""),
          OutputChunk((8,), "lo", "length", Usage(4, 3, 2))]


@dataclass
class FakeLayout:
    block_size: int = 16


@dataclass
class FakePool:
    decode_blocks: int = 64

    def layout(self) -> FakeLayout:
        return FakeLayout()

    def max_decode_blocks(self) -> int:
        return self.decode_blocks


@dataclass
class FakeServedRequest:
    request: ValidRequest
    script: list[Any]
    owner: FakeRouterCore

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def chunks(self) -> AsyncGenerator[OutputChunk, None]:
        self.owner.opened += 1
        try:
            for item in self.script:
                if item == HOLD:
                    await asyncio.Event().wait()
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            self.owner.closed += 1


@dataclass
class FakeRouterCore:
    limits: ModelLimits
    tokenizer: Any
    script: list[Any] = field(default_factory=lambda: list(CHUNKS))
    refuse: RouteError | None = None
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    pool: FakePool = field(default_factory=FakePool)
    started: list[tuple[ClientRequest, float | None]] = field(default_factory=list)
    opened: int = 0
    closed: int = 0

    gated: list[int] = field(default_factory=list)
    seal: ResumeSeal = field(default_factory=lambda: ResumeSeal(()))  # router.resume

    def gate(self, num_tokens: int, timeout_s: float | None) -> None:
        self.gated.append(num_tokens)
        if self.refuse is not None:
            raise self.refuse

    async def run_text_work(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def start(self, client: ClientRequest, timeout_s: float | None) -> FakeServedRequest:
        self.started.append((client, timeout_s))
        request = validate(client, self.limits, self.tokenizer)  # the router's messages
        if self.refuse is not None:
            raise self.refuse
        return FakeServedRequest(request, self.script, self)


@pytest.fixture
def fake(llama_dir: Path) -> FakeRouterCore:
    info = load_tokenizer(llama_dir)
    return FakeRouterCore(ModelLimits.from_model_dir(llama_dir, "tiny", info), info.tokenizer)


def make_api(fake: FakeRouterCore, llama_dir: Path, **overrides: Any) -> HttpApi:
    fields: dict[str, Any] = {"core": fake, "tokenizer": fake.tokenizer,
                              "serving": lambda: True, "version": "9.9",
                              "chat_template": load_chat_template(llama_dir)}
    return HttpApi(**{**fields, **overrides})


@pytest.fixture
def client(fake: FakeRouterCore, llama_dir: Path) -> Iterator[TestClient]:
    with TestClient(build_app(make_api(fake, llama_dir))) as c:
        yield c


def events(response: Any) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines.get("event"), lines["data"]))
    return out


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


# ------------------------------------------------------------------------ shapes

def test_completion_response(client: TestClient, fake: FakeRouterCore) -> None:
    response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                           headers={"x-request-id": "abc-1"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "abc-1"
    body = response.json()
    assert body["id"] == "cmpl-abc-1" and body["object"] == "text_completion"
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert fake.started[0][0].text == "Hi" and fake.closed == 1


def test_completion_stream_with_usage(client: TestClient) -> None:
    response = client.post("/v1/completions", json={
        "prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    got = events(response)
    assert got[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in got[:-1]]
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "lo", "logprobs": None, "finish_reason": "length"}], []]
    assert [c["usage"] for c in chunks[:-1]] == [None, None]  # the empty chunk is skipped
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert {c["object"] for c in chunks} == {"text_completion"}


def test_chat_stream_role_deltas_finish_usage(client: TestClient, fake: FakeRouterCore,
                                             llama_dir: Path) -> None:
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(data) for _, data in events(response)[:-1]]
    assert [c["choices"][0]["delta"] if c["choices"] else None for c in chunks] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}, None]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None,
                                                                       "length"]
    assert chunks[-1]["usage"]["total_tokens"] == 7
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["id"].startswith("chatcmpl-")
    # the conversation went through the chat template, tokenized without added specials
    template = load_chat_template(llama_dir)
    assert template is not None
    rendered = template.render([{"role": "user", "content": "Hi"}])
    assert fake.started[0][0].token_ids == tuple(
        fake.tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert fake.started[0][0].max_tokens == 3


def test_chat_response_and_default_max_tokens(client: TestClient, fake: FakeRouterCore) -> None:
    response = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "Hi"}]})
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    client_request = fake.started[0][0]
    assert client_request.token_ids is not None
    # no max_tokens: the room left in the largest decode worker (64 blocks of 16 tokens)
    assert client_request.max_tokens == 64 * 16 - len(client_request.token_ids)


def test_models_health_version_metrics(fake: FakeRouterCore, llama_dir: Path) -> None:
    serving = [True]
    fake.metrics.requests.labels("OK", "stop").inc()
    app = build_app(make_api(fake, llama_dir, serving=lambda: serving[0], created=123))
    with TestClient(app) as client:
        assert client.get("/v1/models").json()["data"] == [{
            "id": "tiny", "object": "model", "created": 123, "owned_by": "pdserve",
            "root": "tiny", "parent": None, "max_model_len": fake.limits.context_length}]
        assert client.get("/health").status_code == 200
        serving[0] = False
        assert client.get("/health").status_code == 503
        assert client.get("/version").json() == {"version": "9.9"}
        metrics = client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        assert 'pdserve:router_requests_total{finish_reason="stop",status="OK"} 1.0' in (
            metrics.text)


# ------------------------------------------------------------------------ errors

def test_validation_errors_carry_the_grpc_message(client: TestClient,
                                                   fake: FakeRouterCore) -> None:
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi", "temperature": -1}),
                     400)
    assert error["message"] == "temperature must be finite and >= 0, got -1.0"
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    error = error_of(client.post("/v1/completions", json={"prompt": ""}), 400)
    assert error["message"].startswith("prompt is empty")
    assert fake.opened == 0  # nothing started


def test_unknown_model_is_404(client: TestClient, fake: FakeRouterCore) -> None:
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi", "model": "gpt-9"}),
                     404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert not fake.started


@pytest.mark.parametrize(("code", "status"), [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.INTERNAL, 500)])
@pytest.mark.parametrize("where", ["start", "before the first chunk"])
def test_route_errors_map_to_http_statuses(client: TestClient, fake: FakeRouterCore,
                                           code: grpc.StatusCode, status: int,
                                           where: str) -> None:
    error = RouteError(code, "no luck", "max_inflight")
    if where == "start":
        fake.refuse = error
    else:
        fake.script = [error]
    for stream in (False, True):
        got = error_of(client.post("/v1/completions", json={"prompt": "Hi", "stream": stream}),
                       status)
        assert got["message"] == "no luck" and got["code"] == code.name.lower()


def test_an_error_mid_stream_is_an_sse_error_then_done(client: TestClient,
                                                       fake: FakeRouterCore) -> None:
    fake.script = [CHUNKS[0], RouteError(grpc.StatusCode.UNAVAILABLE, "decode worker died")]
    response = client.post("/v1/completions", json={"prompt": "Hi", "stream": True})
    assert response.status_code == 200
    got = events(response)
    assert [name for name, _ in got] == [None, "error", None]
    assert json.loads(got[1][1])["error"]["message"] == "decode worker died"
    assert got[2][1] == "[DONE]"
    fake.script = [CHUNKS[0], RouteError(grpc.StatusCode.UNAVAILABLE, "decode worker died")]
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi"}), 503)
    assert error["type"] == "service_unavailable"  # not streamed: a plain error
    assert fake.closed == fake.opened == 2


def test_api_key_on_v1_only(fake: FakeRouterCore, llama_dir: Path) -> None:
    with TestClient(build_app(make_api(fake, llama_dir, api_key=KEY))) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            for response in (client.get("/v1/models", headers=headers),
                             client.post("/v1/completions", json={"prompt": "Hi"},
                                         headers=headers)):
                error = error_of(response, 401)
                assert error["code"] == "invalid_api_key" and KEY not in response.text
        ok = {"authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "Hi"}, headers=ok).status_code == 200
        for path in ("/health", "/metrics", "/version"):
            assert client.get(path).status_code == 200


def test_oversized_bodies_are_413(fake: FakeRouterCore, llama_dir: Path) -> None:
    with TestClient(build_app(make_api(fake, llama_dir, max_body_bytes=2048))) as client:
        big = {"prompt": "x" * 4096}
        error = error_of(client.post("/v1/completions", json=big), 413)
        assert "over the router's limit of 2048 bytes" in error["message"]

        def chunked() -> Iterator[bytes]:  # no content-length: counted while read
            yield json.dumps(big).encode()

        error_of(client.post("/v1/completions", content=chunked()), 413)
    assert not fake.started


def test_chat_without_a_template_is_400(fake: FakeRouterCore, llama_dir: Path) -> None:
    with TestClient(build_app(make_api(fake, llama_dir, chat_template=None))) as client:
        error = error_of(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}]}), 400)
    assert error["code"] == "no_chat_template" and "--chat-template" in error["message"]


def test_timeout_header_and_unknown_routes(client: TestClient, fake: FakeRouterCore) -> None:
    client.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-request-timeout": "2.5"})
    client.post("/v1/completions", json={"prompt": "Hi"})
    assert [timeout for _, timeout in fake.started] == [2.5, None]
    error = error_of(client.post("/v1/completions", json={"prompt": "Hi"},
                                 headers={"x-request-timeout": "soon"}), 400)
    assert error["param"] == "x-request-timeout"
    assert error_of(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    assert error_of(client.get("/v1/completions"), 405)["message"] == "Method Not Allowed"


# ------------------------------------------------------------------------ the client leaves

async def _run_until_disconnect(app: Any, body: dict[str, Any], *,
                                leave_after_body_chunks: int) -> list[dict[str, Any]]:
    """Calls the ASGI app as uvicorn does; the client disconnects after receiving
    ``leave_after_body_chunks`` body messages (0: right after sending the request)."""
    left = asyncio.Event()
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= leave_after_body_chunks:
            left.set()

    if leave_after_body_chunks == 0:
        left.set()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


@pytest.mark.parametrize(("stream", "script", "leave_after"), [
    (True, [CHUNKS[0], HOLD], 1),  # mid-stream, waiting for the next token
    (True, [HOLD], 0),  # queued: before the first token, nothing sent yet
    (False, [CHUNKS[0], HOLD], 0),  # waiting for a non-streamed response
])
def test_a_client_that_leaves_closes_the_request(fake: FakeRouterCore, llama_dir: Path,
                                                    stream: bool, script: list[Any],
                                                    leave_after: int) -> None:
    fake.script = script
    app = build_app(make_api(fake, llama_dir))
    sent = asyncio.run(_run_until_disconnect(app, {"prompt": "Hi", "stream": stream},
                                             leave_after_body_chunks=leave_after))
    assert fake.opened == 1 and fake.closed == 1  # the chunks generator was closed
    assert not any(m.get("more_body") is False for m in sent)  # and the response never ended


class CountingTemplate:
    """A chat template that counts how often it renders."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.renders = inner, 0

    def render(self, *args: Any, **kwargs: Any) -> str:
        self.renders += 1
        return str(self.inner.render(*args, **kwargs))


def test_a_chat_request_is_gated_before_its_template_renders(fake: FakeRouterCore,
                                                             llama_dir: Path) -> None:
    template = CountingTemplate(load_chat_template(llama_dir))
    with TestClient(build_app(make_api(fake, llama_dir, chat_template=template))) as client:
        chat = {"messages": [{"role": "user", "content": "Hi there"}]}
        # 1. the router refuses (draining, deadline, budgets): the template never renders
        fake.refuse = RouteError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        error_of(client.post("/v1/chat/completions", json=chat), 503)
        assert template.renders == 0 and fake.gated and fake.gated[-1] >= 8
        fake.refuse = None
        # 2. too many messages: refused naming the limit, nothing rendered
        many = {"messages": [{"role": "user", "content": "x"}] * 4097}
        error = error_of(client.post("/v1/chat/completions", json=many), 400)
        assert "at most 4096 messages" in error["message"] and template.renders == 0
        # 3. a conversation of many messages renders off the event loop, then runs
        long = {"messages": [{"role": "user", "content": "hi"}] * 20, "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=long).status_code == 200
        assert template.renders == 1


def test_an_sse_event_is_one_line_to_any_line_splitter() -> None:
    """A token's text may hold U+0085, U+2028 or U+2029, which JSON leaves as they are and
    str.splitlines (httpx's iter_lines) breaks on: the event escapes them, and its data
    still decodes to the same text."""
    from router.http.responses import sse

    text = "a\u0085b\u2028c\u2029d\x1ce\n"
    event = sse({"content": text}).decode()
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0].removeprefix("data: ")) == {"content": text}


def test_an_echoed_prompt_of_bad_token_ids_is_a_400_and_a_server_bug_a_json_500(
        fake: FakeRouterCore, llama_dir: Path) -> None:
    class Broken:
        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise RuntimeError("a bug")

    app = build_app(make_api(fake, llama_dir))
    with TestClient(app, raise_server_exceptions=False) as c:
        for ids in ([-1], [1 << 40]):  # decoded before, these failed as a text/plain 500
            error = error_of(c.post("/v1/completions", json={"prompt": ids, "echo": True}),
                             400)
            assert "outside the vocabulary" in error["message"]
    app = build_app(make_api(fake, llama_dir, tokenizer=Broken()))
    with TestClient(app, raise_server_exceptions=False) as c:
        response = c.post("/v1/completions", json={"prompt": [5], "echo": True},
                          headers={"x-request-id": "bug-1"})
        assert response.headers["x-request-id"] == "bug-1"
        error = error_of(response, 500)
        assert error["message"] == "the server failed: RuntimeError"
        assert error["code"] == "internal" and error["type"] == "server_error"
    assert fake.opened == 0
