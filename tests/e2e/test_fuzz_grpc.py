"""Property-based fuzzing of the public gRPC API on one real cluster (1 prefill, 1 decode,
TP 1, ``--max-inflight MAX_INFLIGHT``), and the harness ``test_fuzz_http`` shares. Inputs: raw
bytes (broken protobuf, unknown fields, wrong wire types, bad UTF-8, deep groups) to
``Generate`` and ``GetModelInfo``; requests valid but for up to three fields at a boundary,
odd metadata, tiny or huge deadlines; cancels. Each call answers within its deadline +
``GRACE_S`` (a watchdog cancels it at ``HANG_S``) with a documented status: OK,
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED once its deadline passed, CANCELLED if
the test cancelled — never UNKNOWN, INTERNAL or UNAVAILABLE (the cluster is healthy). Every
``CHECK_EVERY`` inputs and after each property a 1-token completion succeeds on both APIs; the
autouse leak check ends every test. ``DEFAULT_EXAMPLES`` derandomized examples per property,
or ``PDSERVE_FUZZ_EXAMPLES`` (2000) random ones with ``-m slow``; ``TRIED``/``OUTCOMES`` counts
are printed at the end.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import httpx2
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from pdserve.v1 import generate_pb2 as pb
from tests.e2e.cluster import Cluster
from tests.worker.kv.faults import CORRUPT_NUM_TOKENS

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.filterwarnings("ignore:Generating overly large repr")]

MAX_INFLIGHT = 4
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1,
           "router_args": ("--http-port", "0", "--max-inflight", str(MAX_INFLIGHT))}
DEFAULT_EXAMPLES = 70
SLOW_EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "2000"))
GRACE_S = 5.0  # a call answers within its deadline + this
HANG_S = 30.0  # no call takes longer: the watchdog cancels it and the example fails
CHECK_EVERY = 10  # inputs between two "the next valid request succeeds" checks
GENERATE, MODEL_INFO = "/pdserve.v1.Generation/Generate", "/pdserve.v1.Generation/GetModelInfo"
TRIED: Counter[str] = Counter()  # inputs sent, by property
OUTCOMES: Counter[str] = Counter()  # what they ended with
Code = grpc.StatusCode
NAN, INF = math.nan, math.inf
NO_CHARS = st.characters(exclude_categories=["Cs"])  # what a proto string can hold
@dataclass
class Target:
    channel: grpc.Channel
    http: httpx2.Client
    info: pb.ModelInfo


def open_target(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Target]:
    """A module's ``target`` fixture: a channel and an HTTP client; prints the counts."""
    assert cluster.router is not None
    with grpc.insecure_channel(cluster.address) as channel, httpx2.Client(
            base_url=f"http://{cluster.router.ready['http_address']}", timeout=HANG_S) as http:
        info = pb.ModelInfo.FromString(channel.unary_unary(MODEL_INFO)(b"", timeout=30.0))
        # spend prefill-0's test-only KV fault hook (tests.e2e.cluster): it would fail a case
        spend = pb.GenerateRequest(token_ids=pb.TokenIds(ids=range(1, 1 + CORRUPT_NUM_TOKENS)))
        with contextlib.suppress(grpc.RpcError):
            list(channel.unary_stream(GENERATE)(spend.SerializeToString(), timeout=30.0))
        yield Target(channel, http, info)
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nfuzz inputs tried: {sum(TRIED.values())} {dict(TRIED)}")
            reporter.write_line(f"fuzz outcomes: {dict(sorted(OUTCOMES.items()))}")


@pytest.fixture(scope="module")
def target(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Target]:
    yield from open_target(cluster, request)


def _retrying(send: Callable[[], Any]) -> Any:
    """``send()`` again while refused as busy (RESOURCE_EXHAUSTED, 429: a cancelled call may
    hold one of the MAX_INFLIGHT places a moment after its cancel), for up to 15 s."""
    for _ in range(150):
        try:
            reply = send()
        except grpc.RpcError as exc:
            if exc.code() != Code.RESOURCE_EXHAUSTED:
                raise
        else:
            if getattr(reply, "status_code", 200) != 429:
                return reply
        OUTCOMES["serve check retried busy"] += 1
        time.sleep(0.1)
    return send()


def assert_serves(t: Target) -> None:
    """The next valid request succeeds on both APIs (1 greedy token)."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True)).SerializeToString()
    replies = _retrying(lambda: list(t.channel.unary_stream(GENERATE)(request, timeout=30.0)))
    last = pb.GenerateResponse.FromString(replies[-1])
    assert (last.finish_reason, last.usage.completion_tokens) == ("length", 1)
    reply = _retrying(lambda: t.http.post("/v1/completions", json={
        "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0, "ignore_eos": True}))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1


def tried(t: Target, kind: str) -> None:
    TRIED[kind] += 1
    if TRIED[kind] % CHECK_EVERY == 0:
        assert_serves(t)


def deadline_passed(timeout: float | None, elapsed: float) -> bool:
    return timeout is not None and elapsed >= timeout - 0.25


def run_property(t: Target, prop: Callable[[Target, Any], None], strategy: st.SearchStrategy[Any],
                 examples: int, derandomize: bool, explicit: tuple[Any, ...] = ()) -> None:
    """``prop(t, case)`` for ``examples`` generated cases and the ``explicit`` ones."""
    test = given(strategy)(lambda case: prop(t, case))
    for case in explicit:
        test = example(case)(test)
    settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
             phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
             suppress_health_check=list(HealthCheck), print_blob=not derandomize)(test)()
    assert_serves(t)


def split_cases(valid: dict[str, st.SearchStrategy[Any]], edge: dict[str, st.SearchStrategy[Any]],
                groups: tuple[tuple[tuple[str, ...], int], ...]) -> st.SearchStrategy[Any]:
    """Cases valid but for a few fields drawn from ``edge``: up to ``n`` of each group's."""

    @st.composite
    def cases(draw: st.DrawFn) -> dict[str, Any]:
        broken = set().union(*(draw(st.sets(st.sampled_from(names), max_size=n))
                               for names, n in groups))
        return {name: draw(edge[name] if name in broken else valid[name]) for name in valid}

    return cases()


# ------------------------------------------------------------------------------ calls

def _stop(flag: threading.Event, call: grpc.Future) -> None:
    flag.set()
    call.cancel()


def call_grpc(t: Target, raw: bytes, timeout: float, metadata: tuple[tuple[str, Any], ...] = (),
              cancel_after: float | None = None, method: str = GENERATE) -> grpc.StatusCode:
    """One call of ``raw`` bytes; asserts the properties of the module doc, returns its code."""
    started = time.monotonic()
    call: Any = (t.channel.unary_stream(method) if method == GENERATE else
                 t.channel.unary_unary(method).future)(raw, timeout=timeout, metadata=metadata)
    hung, cancelled = threading.Event(), threading.Event()
    timers = [threading.Timer(HANG_S, _stop, (hung, call)), threading.Timer(  # no cancel: never
        2 * HANG_S if cancel_after is None else cancel_after, _stop, (cancelled, call))]
    for timer in timers:
        timer.daemon = True
        timer.start()
    messages: list[bytes] = []
    try:
        messages.extend(call if method == GENERATE else [call.result()])
        code, details = Code.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    except grpc.FutureCancelledError:
        code, details = Code.CANCELLED, "future cancelled"
    finally:
        for timer in timers:
            timer.cancel()
    elapsed = time.monotonic() - started
    OUTCOMES[f"grpc {code.name}"] += 1
    assert not hung.is_set(), f"no answer in {HANG_S}s"
    assert elapsed <= timeout + GRACE_S, f"answered after {elapsed:.1f}s, deadline {timeout}s"
    allowed = {Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}
    allowed |= {Code.DEADLINE_EXCEEDED} if deadline_passed(timeout, elapsed) else set()
    allowed |= {Code.CANCELLED} if cancelled.is_set() else set()
    assert code in allowed, f"{code.name} after {elapsed:.2f}s: {details}"
    if code == Code.OK and method == GENERATE:
        replies = [pb.GenerateResponse.FromString(m) for m in messages]
        assert replies and replies[-1].finish_reason in ("stop", "length"), replies[-1:]
        assert all(not r.finish_reason for r in replies[:-1])
        assert len({r.request_id for r in replies}) == 1 and replies[0].request_id
    return code


# -------------------------------------------------------------------------- raw bytes

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def key(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def ld(field: int, payload: bytes) -> bytes:  # a length-delimited field
    return key(field, 2) + varint(len(payload)) + payload


INT64S = [-(1 << 63), -(1 << 31), -1, 0, 1, 2, 16, (1 << 31) - 1, 1 << 32, (1 << 63) - 1]
FIELDS = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 19000, (1 << 29) - 1]),
                   st.integers(0, (1 << 29) - 1))
BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"a\x00\xfe"])


@st.composite
def wire_field(draw: st.DrawFn, depth: int = 0) -> bytes:
    """One protobuf field of any number and wire type, often broken."""
    field, wire = draw(FIELDS), draw(st.integers(0, 7))
    if wire == 0:
        return key(field, 0) + draw(st.one_of(st.sampled_from(INT64S), st.integers()).map(varint)
                                    | st.just(b"\xff" * 11))
    if wire in (1, 5):
        return key(field, wire) + draw(st.binary(min_size=8 if wire == 1 else 4, max_size=8))
    if wire == 2:
        inner = (st.lists(wire_field(depth + 1), max_size=3).map(b"".join) if depth < 2
                 else st.binary(max_size=8))
        payload = draw(st.one_of(st.binary(max_size=32), BAD_UTF8, inner))
        length = draw(st.sampled_from([len(payload), len(payload) + 1, (1 << 31) - 1, 1 << 63]))
        return key(field, 2) + varint(length) + payload
    if wire == 3:  # a group, nested or left open
        n = draw(st.sampled_from([1, 2, 99, 100, 101, 5000]))
        return key(field, 3) * n + key(field, 4) * draw(st.sampled_from([n, n - 1, 0]))
    return key(field, wire) + draw(st.binary(max_size=4))  # 4: a stray end group; 6, 7: invalid


VALID_RAW = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
    max_tokens=2, temperature=0.0, stop=["x"])).SerializeToString()


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    base = draw(st.sampled_from([b"", VALID_RAW, ld(4, ld(1, b"\x01\x02")), ld(5, b"")]))
    bad_string = st.tuples(st.sampled_from([1, 2, 3]), BAD_UTF8).map(lambda f: ld(*f))
    bad_stop = BAD_UTF8.map(lambda b: ld(5, ld(6, b)))
    data = base + b"".join(draw(st.lists(wire_field() | bad_string | bad_stop, max_size=4)))
    if data and draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data) - 1))]  # truncated
    if data and draw(st.booleans()):
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    data = draw(st.one_of(st.just(data), st.binary(max_size=64)))
    return draw(st.sampled_from([GENERATE] * 4 + [MODEL_INFO])), data


def prop_grpc_raw(t: Target, case: tuple[str, bytes]) -> None:
    call_grpc(t, case[1], timeout=10.0, method=case[0])
    tried(t, "grpc raw bytes")


RAW_EXPLICIT = ((GENERATE, key(1, 3) * 5000), (GENERATE, ld(3, b"\xff")), (MODEL_INFO, b"\xff"),
                (GENERATE, ld(5, ld(6, b"\xc3"))), (GENERATE, VALID_RAW + ld(99, b"x")))


# ------------------------------------------------------------------- well-formed messages

SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
            "ignore_eos")


def generate_requests(info: pb.ModelInfo) -> st.SearchStrategy[dict[str, Any]]:
    """Valid requests but for up to three fields at a boundary; None: a field left unset."""
    vocab, ctx = info.vocab_size, info.context_length
    ids = st.integers(0, vocab - 1)
    bad_ids = st.sampled_from([vocab, (1 << 31) - 1, (1 << 32) - 1, -1, -(1 << 63), (1 << 63) - 1])
    floats = st.sampled_from([NAN, INF, -INF, -0.0, 0.0, 1e-45, 1e-40, 1.0000001, 2.0, 3.4e38,
                              1e308, -1.0, -1e-45]) | st.floats(width=32)
    unset = st.none()
    valid: dict[str, st.SearchStrategy[Any]] = {
        "request_id": st.just("") | st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True),
        "model": st.sampled_from(["", info.model]), "sampling": st.just(True),
        "prompt": st.text(NO_CHARS, min_size=1, max_size=40).map(lambda s: ("text", s))
        | st.lists(ids, min_size=1, max_size=12).map(lambda s: ("ids", s)),
        "max_tokens": unset | st.integers(1, 24), "ignore_eos": unset | st.booleans(),
        "temperature": unset | st.sampled_from([0.0, 1e-45, 0.7, 1.0]) | st.floats(0, 5, width=32),
        "top_p": unset | st.sampled_from([1e-45, 0.5, 1.0]) | st.floats(0.25, 1, width=32),
        "top_k": unset | st.sampled_from([-1, 1]) | st.integers(1, vocab),
        "seed": unset | st.sampled_from([0, (1 << 64) - 1]) | st.integers(0, (1 << 64) - 1),
        "stop": unset | st.lists(st.text(NO_CHARS, min_size=1, max_size=8), max_size=16),
        "stop_token_ids": unset | st.lists(ids, max_size=8),
        "timeout": st.floats(1.0, 10.0) | st.sampled_from([30.0, 86400.0]),
        "metadata": st.just(()), "cancel_after": unset,
    }
    giant = st.sampled_from([4097, 64 * ctx, 64 * ctx + 1, 1 << 20, 5 << 20]).flatmap(
        lambda n: st.sampled_from(["x" * n, " x" * (n // 2), "\u00e9" * n]))
    md_key = st.from_regex(r"x-[a-z0-9_.-]{0,19}[a-z0-9]", fullmatch=True).filter(
        lambda k: not k.endswith("-bin"))
    md_value = (st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
                | st.sampled_from([4000, 7000, 9000, 17_000]).map(lambda n: "v" * n))
    edge: dict[str, st.SearchStrategy[Any]] = {
        "request_id": st.text(NO_CHARS, max_size=20) | st.sampled_from(
            ["a" * 128, "a" * 129, "a" * 100_000, "a b", "\u00e9", "fuzz-shared"]),
        "model": st.sampled_from(["gpt-4", info.model + " ", info.model.upper()]),
        "prompt": st.none() | st.sampled_from(["", " ", "\x00", "\U0010ffff"]).map(
            lambda s: ("text", s)) | giant.map(lambda s: ("text", s))
        | st.lists(ids | bad_ids, max_size=12).map(lambda s: ("ids", s))
        | st.sampled_from([0, 17, 1000, 1025, ctx - 1, ctx, ctx + 1, 5000, 300_000]).map(
            lambda n: ("ids", [1] * n)),
        "sampling": st.just(False),  # no SamplingParams at all: every default
        "max_tokens": st.sampled_from([*INT64S, 1000, 1024, ctx - 1, ctx, ctx + 1]),
        "temperature": floats, "top_p": floats,
        "top_k": st.sampled_from([-(1 << 31), -2, 0, vocab + 1, (1 << 31) - 1]),
        "seed": st.sampled_from([0, 1, 1 << 63]),
        "stop": st.sampled_from([[""], ["x" * 256], ["x" * 257], ["a"] * 16, ["a"] * 17,
                                 ["x" * 100_000], ["\x00"], [" "]]),
        "stop_token_ids": st.lists(bad_ids, min_size=1, max_size=3)
        | st.sampled_from([1024, 1025, 100_000]).map(lambda n: [2] * n),
        "ignore_eos": st.just(True),
        "timeout": st.sampled_from([0.001, 0.01, 0.1, 86400.0, 86401.0, 1e7]),
        "metadata": st.lists(st.tuples(md_key, md_value), min_size=1, max_size=3)
        | st.sampled_from([[("x-data-bin", b"\x00\xff" * 64)], [("authorization", "Bearer x")],
                           [("pdserve-request-id", "spoofed")], [("grpc-trace-bin", b"\xff")],
                           [("pdserve-trace", "1")], [("pdserve-trace", "1" * 9000)]]),
        "cancel_after": st.floats(0.0, 0.3),
    }
    return split_cases(valid, edge, ((tuple(edge), 3),))


def prop_grpc_messages(t: Target, case: dict[str, Any]) -> None:
    message = pb.GenerateRequest(request_id=case["request_id"], model=case["model"])
    if case["prompt"] is not None:
        kind, value = case["prompt"]
        if kind == "text":
            message.text = value
        else:
            message.token_ids.ids.extend(value)
    if case["sampling"]:
        message.sampling.CopyFrom(pb.SamplingParams(
            **{k: case[k] for k in SAMPLING if case[k] is not None}))
    call_grpc(t, message.SerializeToString(), case["timeout"], tuple(case["metadata"]),
              case["cancel_after"])
    tried(t, "grpc messages")


def prop_grpc_cancels(t: Target, case: list[tuple[float, int, bool]]) -> None:
    """Concurrent streams, each cancelled after its delay (some sharing one request id)."""
    def one(delay: float, max_tokens: int, shared: bool) -> grpc.StatusCode:
        sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        message = pb.GenerateRequest(request_id="fuzz-shared" * shared, text="hi", sampling=sampling)
        return call_grpc(t, message.SerializeToString(), 20.0, cancel_after=delay)

    with ThreadPoolExecutor(len(case)) as pool:
        list(pool.map(lambda c: one(*c), case))
    tried(t, "grpc concurrent cancels")


CANCELS = st.lists(st.tuples(st.floats(0.0, 0.3), st.integers(1, 64), st.booleans()),
                   min_size=1, max_size=6)  # (cancel after, max_tokens, shared request id)


def run(name: str, t: Target, examples: int, derandomize: bool) -> None:
    props: dict[str, tuple[Callable[[Target, Any], None], st.SearchStrategy[Any], int]] = {
        "raw": (prop_grpc_raw, raw_requests(), examples),
        "messages": (prop_grpc_messages, generate_requests(t.info), examples),
        "cancels": (prop_grpc_cancels, CANCELS, examples // 3)}  # a case: up to 6 calls
    prop, strategy, count = props[name]
    run_property(t, prop, strategy, count, derandomize, RAW_EXPLICIT if name == "raw" else ())


@pytest.mark.parametrize("name", ["raw", "messages", "cancels"])
def test_grpc_fuzz(name: str, cluster: Cluster, target: Target) -> None:
    run(name, target, DEFAULT_EXAMPLES, derandomize=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["raw", "messages", "cancels"])
def test_grpc_fuzz_long(name: str, cluster: Cluster, target: Target) -> None:
    run(name, target, SLOW_EXAMPLES, derandomize=False)
