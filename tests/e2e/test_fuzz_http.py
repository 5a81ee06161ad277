"""Property-based fuzzing of the router's OpenAI-compatible HTTP API on one real cluster
(the layout and harness of ``test_fuzz_grpc``, whose module doc states the properties).

Inputs: requests valid but for up to three things — a body field of the wrong type or at
an extreme (huge ints, 1e400, NaN and Infinity literals, giant strings, odd chat roles
and content parts, unsupported and internal parameters), a broken body (truncated,
invalid UTF-8, 10,000 nested arrays, random bytes, not an object), an odd content type,
method or path, an ``X-Request-Timeout`` of garbage, 1e17, -1, nan or a tiny deadline,
odd ``X-Request-Id``/``Authorization``/large headers, a stream closed mid-way.

Properties: 200 or a documented 4xx (504 only once the request's deadline passed) within
the deadline + ``GRACE_S``, never a 5xx or a hang; an error has OpenAI's body
(``{"error": {"message", "type", ...}}``) and is not typed ``server_error``; a stream that
is read to its end ends with ``data: [DONE]`` and carries no error event but a timeout.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from hypothesis import strategies as st

from router.http.protocol import INTERNAL_FIELDS, UNSUPPORTED
from tests.e2e.cluster import Cluster
from tests.e2e.test_fuzz_grpc import (
    CLUSTER,
    DEFAULT_EXAMPLES,
    GRACE_S,
    HANG_S,
    INF,
    NAN,
    OUTCOMES,
    SLOW_EXAMPLES,
    Target,
    deadline_passed,
    open_target,
    run_property,
    split_cases,
    tried,
)

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore:Generating overly large repr")]

__all__ = ["CLUSTER"]  # the layout conftest starts, as test_fuzz_grpc's


class Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = Absent()  # a field left out of the body
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]
ODD_ROUTES = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
              ("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"),
              ("DELETE", "/v1/models"), ("OPTIONS", "/v1/completions"), ("GET", "/nope"),
              ("POST", "/v1/embeddings"), ("POST", "/v1/models"), ("GET", "/v1/chat/completions"),
              ("POST", "/v1/completions?stream=true"), ("POST", "/v1//completions")]
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
                    | st.sampled_from([1 << 63, 1 << 64, 10**400, -(10**400)]) | st.floats()
                    | st.text(max_size=10), lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)
TIMEOUTS = st.sampled_from(["", "garbage", "1e17", "-1", "0", "-0", "nan", "inf", "1e-9",
                            "0.001", "0.05", "0.3", "1_0", "+2", "0x10", "86400", "86400.5"])
PRINTABLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)


def requests() -> st.SearchStrategy[dict[str, Any]]:
    """A request: route, headers, how the body is broken, and the body's fields."""
    short = st.text(max_size=20)
    short1 = st.text(min_size=1, max_size=20)
    ids = st.lists(st.integers(1, 600), min_size=1, max_size=8)
    ints = st.sampled_from([-(1 << 63) - 1, -(1 << 63), -1, 0, 2048, 100_000, (1 << 63) - 1,
                            1 << 63, 10**30, 10**400])
    nums = st.sampled_from([-0.0, 1e-45, 1e-300, 2.0, -1, -1e-45, 1e308, NAN, INF, -INF,
                            10**400, True, "1"]) | st.floats()
    giant = st.sampled_from([4097, 200_000, 5 << 20]).map(lambda n: "y" * n)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                     "content": short1 | st.lists(st.fixed_dictionaries(
                                         {"type": st.just("text"), "text": short}), max_size=2)})
    odd_message = st.fixed_dictionaries({"role": st.sampled_from(
        ["tool", "", "\U0001f4a5", "developer", "user\n"]) | JUNK}, optional={
        "content": st.none() | giant | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["image_url", "", "input_audio", "text"]) | JUNK},
            optional={"text": JUNK, "image_url": JUNK}), max_size=3) | JUNK,
        "name": JUNK, "tool_calls": JUNK, "tool_call_id": JUNK})
    extras = st.sampled_from([*UNSUPPORTED, *INTERNAL_FIELDS, "unknown", "stream_usage"])
    plain = st.just(ABSENT)
    valid: dict[str, st.SearchStrategy[Any]] = {
        "route": st.sampled_from(ROUTES),
        "body_kind": st.just(("json", 0, b"", 0)),
        "content_type": st.sampled_from([None, "application/json"]),
        "timeout": st.none() | st.floats(5.0, 20.0).map(str),
        "headers": st.just({}),
        "close_after": st.none(),
        "prompt": short1 | ids | st.lists(short1, min_size=1, max_size=1)
        | st.lists(ids, min_size=1, max_size=1),
        "messages": st.lists(message, min_size=1, max_size=3),
        "max_tokens": plain | st.integers(1, 4),
        "max_completion_tokens": st.integers(1, 4),  # absent: up to the context length
        "temperature": plain | st.floats(0, 2), "top_p": plain | st.floats(0.01, 1),
        "top_k": plain | st.sampled_from([-1, 1, 50]), "seed": plain | st.integers(0, (1 << 64) - 1),
        "stop": plain | short1 | st.lists(short1, max_size=4),
        "stop_token_ids": plain | ids, "ignore_eos": plain | st.booleans(),
        "stream": plain | st.booleans(), "stream_options": plain,
        "request_id": plain | st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True),
        "model": plain | st.just(""), "user": plain | short,
        "chat_template_kwargs": plain | st.just({}), "add_generation_prompt": plain | st.booleans(),
        "extra": st.just({}),
    }
    edge: dict[str, st.SearchStrategy[Any]] = {
        "route": st.sampled_from(ODD_ROUTES),
        "body_kind": st.tuples(st.sampled_from(["truncated", "inserted", "nested", "binary",
                                                "junk", "nested prompt", "nested messages"]),
                               st.integers(0, 1 << 20), st.sampled_from(
                                   [b"\xff\xfe", b"\xc3", b"1e400", b"-1e400", b"NaN",
                                    b"-Infinity", b"1e-400", b"\x00", b'"\\ud800"', b",", b"}"]),
                               st.sampled_from([2, 200, 10_000])),
        "content_type": st.sampled_from(["text/plain", "*/*", "application/json; charset=utf-16",
                                         "multipart/form-data; boundary=x", "x" * 4000, ""]),
        "timeout": TIMEOUTS | st.text(PRINTABLE, max_size=20),
        "headers": st.dictionaries(
            st.sampled_from(["x-request-id", "authorization", "x-big", "accept",
                             "content-encoding", "expect"]),
            st.sampled_from(["", "gzip", "a b", "Bearer x", "v" * 7000, "\u00e9t\u00e9",
                             "100-continue"]), min_size=1, max_size=2),
        "close_after": st.integers(0, 3),
        "prompt": plain | st.sampled_from(["", [], [[]], [[1], [2]], ["a", "b"], [""]]) | giant
        | st.lists(st.integers(1, 600) | ints, max_size=8) | JUNK,
        "messages": plain | st.just([]) | st.lists(odd_message, min_size=1, max_size=3) | JUNK,
        "max_tokens": st.none() | ints | JUNK, "max_completion_tokens": plain | ints | JUNK,
        "temperature": nums | JUNK, "top_p": nums | JUNK, "top_k": ints | nums | JUNK,
        "seed": ints | nums | JUNK,
        "stop": st.sampled_from(["", [""], ["x" * 257], ["a"] * 17]) | giant | JUNK,
        "stop_token_ids": st.lists(ints, min_size=1, max_size=3) | JUNK,
        "ignore_eos": JUNK, "stream": st.sampled_from(["true", 1, 0, None]) | JUNK,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JUNK}) | JUNK,
        "request_id": st.text(max_size=20) | st.sampled_from(["a" * 129, "a b"]) | JUNK,
        "model": st.sampled_from(["nope", "M0-LLAMA"]) | JUNK, "user": JUNK,
        "chat_template_kwargs": st.dictionaries(st.sampled_from(
            ["messages", "add_generation_prompt", "bos_token", "tools", "x"]), JUNK) | JUNK,
        "add_generation_prompt": JUNK,
        "extra": st.dictionaries(extras, JUNK | st.sampled_from([1, 0, False, "", {}, [], "none"]),
                                 min_size=1, max_size=3),
    }
    body_fields = tuple(name for name in edge if name not in REQUEST_FIELDS)
    return split_cases(valid, edge, ((REQUEST_FIELDS, 1), (body_fields, 2)))


REQUEST_FIELDS = ("route", "body_kind", "content_type", "timeout", "headers", "close_after")


def body_of(case: dict[str, Any]) -> bytes:
    """The body the case sends: its fields as JSON (NaN, Infinity literals kept), broken as
    ``body_kind`` says."""
    fields = {k: v for k, v in case.items()
              if k not in (*REQUEST_FIELDS, "extra") and v is not ABSENT}
    data = json.dumps({**fields, **case["extra"]}).encode()
    kind, at, insert, depth = case["body_kind"]
    nested = b"[" * depth + b"1" + b"]" * depth
    at %= len(data) + 1
    return {"json": data, "truncated": data[:at], "inserted": data[:at] + insert + data[at:],
            "nested": nested, "binary": data[at % 7::3] + insert, "junk": json.dumps(
                [*fields.values()][:1]).encode(), "nested prompt": b'{"prompt": ' + nested + b"}",
            "nested messages": b'{"messages": [' + nested + b"]}"}[kind]


def header_timeout(value: str | None) -> float | None:
    """The deadline an X-Request-Timeout header sets (None: refused, or the default)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if 0 < seconds <= 86400 else None


def prop_http(t: Target, case: dict[str, Any]) -> None:
    method, path = case["route"]
    headers = {k: v.encode("latin-1") for k, v in case["headers"].items()}
    if case["content_type"] is not None:
        headers["content-type"] = case["content_type"].encode()
    if case["timeout"] is not None:
        headers["x-request-timeout"] = case["timeout"].encode()
    deadline = header_timeout(case["timeout"])
    started = time.monotonic()
    lines: list[str] = []
    body = b""
    try:
        with t.http.stream(method, path, headers=headers,
                           content=body_of(case) if method in ("POST", "PUT") else None) as reply:
            status, content_type = reply.status_code, reply.headers.get("content-type", "")
            if status == 200 and content_type.startswith("text/event-stream"):
                for line in reply.iter_lines():
                    lines.append(line)
                    if case["close_after"] is not None and len(lines) > case["close_after"]:
                        break  # hang up mid-stream
            else:
                body = reply.read()
    except httpx2.TimeoutException as exc:
        raise AssertionError(f"no answer in {HANG_S}s: {exc!r}") from None
    elapsed = time.monotonic() - started
    OUTCOMES[f"http {status}"] += 1
    assert elapsed <= min(deadline or HANG_S, HANG_S) + GRACE_S, f"answered after {elapsed:.1f}s"
    check_reply(path, status, content_type, body, lines, case["close_after"] is not None,
                deadline_passed(deadline, elapsed))
    tried(t, "http")


def check_reply(path: str, status: int, content_type: str, body: bytes, lines: list[str],
                closed: bool, late: bool) -> None:
    """A documented status with OpenAI's error body; a whole stream ends with [DONE]."""
    assert status in {200, 400, 404, 405, 413, 415, 422, 429} | ({504} if late else set()), (
        status, body[:300])
    if status != 200:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["type"] != "server_error", error
    elif content_type.startswith("text/event-stream"):
        events = [line for line in lines if line.startswith(("data:", "event:"))]
        for line in events:
            if line.startswith("event:"):  # an error after the stream started
                assert line == "event: error", line
            elif line != "data: [DONE]":
                data = json.loads(line.removeprefix("data:"))
                assert "error" not in data or (data["error"]["type"] == "timeout" and late), data
        assert closed or events[-1] == "data: [DONE]", events[-3:]
    elif path.startswith("/v1/") and "json" in content_type:
        assert json.loads(body)["choices" if path != "/v1/models" else "data"]


def explicit(route: int, **fields: Any) -> dict[str, Any]:
    """A written case: a valid body for either endpoint (``ROUTES[route]``) but for ``fields``."""
    return {"route": ROUTES[route], "body_kind": ("json", 0, b"", 0), "close_after": None,
            "content_type": None, "timeout": None, "headers": {}, "extra": {}, "prompt": "a",
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "max_completion_tokens": 1, **{k: ABSENT for k in (
                "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                "stream", "stream_options", "request_id", "model", "user",
                "chat_template_kwargs", "add_generation_prompt")}, **fields}


EXPLICIT = (explicit(0, body_kind=("nested", 0, b"", 10_000)),
            explicit(1, stream=True, close_after=1, timeout="nan", max_completion_tokens=50),
            explicit(1, stream=True, timeout="0.05", ignore_eos=True, max_completion_tokens=900),
            explicit(0, timeout="0.001", max_tokens=900),
            explicit(0, body_kind=("inserted", 8, b"\xff", 0)),
            explicit(0, max_tokens=10**400, temperature=10**400, timeout="1e17"),
            explicit(0, top_p=1e-50), explicit(1, temperature=1e39))


@pytest.fixture(scope="module")
def target(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Target]:
    yield from open_target(cluster, request)


def test_http_fuzz(cluster: Cluster, target: Target) -> None:
    run_property(target, prop_http, requests(), 2 * DEFAULT_EXAMPLES, True, EXPLICIT)


@pytest.mark.slow
def test_http_fuzz_long(cluster: Cluster, target: Target) -> None:
    run_property(target, prop_http, requests(), SLOW_EXAMPLES, False)
