"""The cluster token, one layer alone: parsing and rotation (``cluster.token``), and the
server check and channel interceptors (``cluster.auth``) over an in-process gRPC server
with one unary and one streaming method (a channel must add the token to both kinds)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from cluster.auth import cluster_token_interceptor, token_call_interceptors
from cluster.token import (
    CLUSTER_TOKEN_ENV,
    ClusterToken,
    TokenError,
    generate_token,
    load_cluster_token,
    parse_tokens,
)

pytestmark = pytest.mark.timeout(60)

OLD, NEW = "old-token-0123456789", "new-token-9876543210"


def test_tokens_parse_from_a_file_or_the_environment(tmp_path: Any) -> None:
    path = tmp_path / "token"
    path.write_text(f"{NEW}\n{OLD}\n")
    token = load_cluster_token(str(path))
    assert token is not None and token.current == NEW and token.tokens == (NEW, OLD)
    assert load_cluster_token(None, {CLUSTER_TOKEN_ENV: f"{OLD},{NEW}"}) == parse_tokens(
        f"{OLD}\n{NEW}")
    assert load_cluster_token(None, {}) is None
    assert "redacted" in repr(token) and OLD not in repr(token)
    assert len(ClusterToken((generate_token(),)).current) >= 32


@pytest.mark.parametrize("text", ["short", "a b" * 10, ",".join([OLD] * 3)])
def test_bad_tokens_are_refused_without_echoing_them(text: str, tmp_path: Any) -> None:
    with pytest.raises(TokenError) as caught:
        load_cluster_token(None, {CLUSTER_TOKEN_ENV: text})
    assert text not in str(caught.value)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(TokenError, match="is empty"):
        load_cluster_token(str(empty))


def test_either_token_is_accepted_and_the_keys_differ_per_token() -> None:
    rotating = ClusterToken((OLD, NEW))
    assert rotating.accepts(OLD) and rotating.accepts(NEW.encode())
    assert not rotating.accepts("x" * 20) and not rotating.accepts("")
    keys = rotating.kv_keys()
    assert len(set(keys)) == 2 and OLD.encode() not in keys
    assert ClusterToken((NEW,)).kv_keys()[0] == keys[1]


async def _serve(token: ClusterToken) -> tuple[grpc.aio.Server, int]:
    async def unary(request: bytes, context: Any) -> bytes:
        return b"unary"

    async def stream(request: bytes, context: Any) -> Any:
        yield b"stream"

    handlers = grpc.method_handlers_generic_handler("t.S", {
        "U": grpc.unary_unary_rpc_method_handler(unary),
        "S": grpc.unary_stream_rpc_method_handler(stream)})
    server = grpc.aio.server(interceptors=[cluster_token_interceptor(token)])
    server.add_generic_rpc_handlers((handlers,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _both_kinds(port: int, token: ClusterToken | None) -> list[str]:
    """Each kind of call's answer: its payload, or its status code's name."""
    answers = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         interceptors=token_call_interceptors(token)) as ch:
        for call in (lambda: ch.unary_unary("/t.S/U")(b"", timeout=10),
                     lambda: _collect(ch.unary_stream("/t.S/S")(b"", timeout=10))):
            try:
                answers.append((await call()).decode())
            except grpc.aio.AioRpcError as exc:
                answers.append(exc.code().name)
    return answers


async def _collect(call: Any) -> bytes:
    return b"".join([m async for m in call])


def test_calls_of_both_kinds_carry_the_token_and_others_are_refused() -> None:
    async def scenario() -> None:
        server, port = await _serve(ClusterToken((OLD, NEW)))
        try:
            assert await _both_kinds(port, ClusterToken((NEW, OLD))) == ["unary", "stream"]
            assert await _both_kinds(port, ClusterToken((OLD,))) == ["unary", "stream"]
            assert await _both_kinds(port, None) == ["UNAUTHENTICATED"] * 2
            assert await _both_kinds(port, ClusterToken(("z" * 24,))) == ["UNAUTHENTICATED"] * 2
        finally:
            await server.stop(0)

    asyncio.run(scenario())
