"""Unit tests of the SDK's failover (``pdserve.failover``): several router addresses used in
turn, a stream broken by ``UNAVAILABLE`` resumed on the next router with every token id
received and the last resume token, the caller seeing one stream. Against two
``FakeGeneration`` servers (real gRPC on 127.0.0.1); the real routers' resume is tested
end to end in ``tests/e2e/test_migration.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from pdserve import AsyncClient, Client, PdserveError
from pdserve.v1 import generate_pb2, generate_pb2_grpc
from tests.pdserve.fake_generation import RPC_TIMEOUT_S, USAGE, FakeGeneration, Handler

OUTPUT = [([11, 12], "He"), ([13], "llo"), ([14, 15], " wo"), ([16], "rld")]


def serve(fake: FakeGeneration, port: int = 0) -> grpc.Server:
    """A started gRPC server of ``fake`` on 127.0.0.1 (``port`` 0: a free one; sets
    ``fake.address``)."""
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerationServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port(f'127.0.0.1:{port}')}"
    server.start()
    return server


@pytest.fixture
def servers() -> Iterator[list[grpc.Server]]:
    """The servers a test started (stopped after it)."""
    started: list[grpc.Server] = []
    yield started
    for server in started:
        server.stop(grace=None).wait(5)


@pytest.fixture
def fakes(servers: list[grpc.Server]) -> list[FakeGeneration]:
    """Two started ``FakeGeneration`` routers on 127.0.0.1."""
    fakes = [FakeGeneration(), FakeGeneration()]
    servers.extend(serve(fake) for fake in fakes)
    return fakes


def sealed(*, start: int = 0, stop: int = len(OUTPUT), fail: bool = False,
           code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> Handler:
    """Messages ``start:stop`` of ``OUTPUT`` with offsets and resume tokens (``b"after-N"``,
    N tokens), then the end — or, with ``fail``, ``code`` (UNAVAILABLE as from a dying
    router, CANCELLED as from one that stopped while the call reached it)."""
    def handler(request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
                ) -> Iterator[generate_pb2.GenerateResponse]:
        offset = sum(len(ids) for ids, _ in OUTPUT[:start])
        for i in range(start, stop):
            ids, text = OUTPUT[i]
            response = generate_pb2.GenerateResponse(
                request_id="r", token_ids=ids, text=text, offset=offset,
                resume_token=f"after-{offset + len(ids)}".encode())
            offset += len(ids)
            if i == len(OUTPUT) - 1:
                response.finish_reason = "length"
                response.usage.CopyFrom(USAGE)
            yield response
        if fail:
            context.abort(code, "Stream removed" if code is grpc.StatusCode.UNAVAILABLE
                          else "CANCELLED")
    return handler


def test_a_broken_stream_resumes_on_the_next_router(fakes: list[FakeGeneration]) -> None:
    first, second = fakes
    first.handler, second.handler = sealed(stop=2, fail=True), sealed(start=2)
    with Client([first.address, second.address]) as client:
        result = client.complete("Hi", max_tokens=8, seed=3, timeout=RPC_TIMEOUT_S)
    assert list(result.token_ids) == [11, 12, 13, 14, 15, 16] and result.text == "Hello world"
    (broken,), (resumed,) = first.requests, second.requests
    assert not broken.HasField("resume")
    assert list(resumed.resume.token_ids) == [11, 12, 13]
    assert resumed.resume.token == b"after-3"
    # the same request otherwise, so the router can check the seal
    resumed.ClearField("resume")
    assert resumed == broken


def test_the_async_client_resumes_too_and_calls_go_in_turn(
        fakes: list[FakeGeneration]) -> None:
    first, second = fakes
    first.handler, second.handler = sealed(stop=3, fail=True), sealed(start=3)

    async def main() -> tuple[list[int], str]:
        async with AsyncClient([first.address, second.address]) as client:
            result = await client.complete("Hi", max_tokens=8, timeout=RPC_TIMEOUT_S)
            second.handler = first.handler = sealed()
            await client.complete("next", timeout=RPC_TIMEOUT_S)  # the second's turn
            await client.complete("then", timeout=RPC_TIMEOUT_S)  # the first's again
            return list(result.token_ids), result.text

    assert asyncio.run(main()) == ([11, 12, 13, 14, 15, 16], "Hello world")
    assert [r.text for r in first.requests] == ["Hi", "then"]
    assert [r.text for r in second.requests] == ["Hi", "next"]
    assert list(second.requests[0].resume.token_ids) == [11, 12, 13, 14, 15]


def test_before_any_token_the_request_is_sent_again_as_it_was(
        fakes: list[FakeGeneration]) -> None:
    first, second = fakes
    first.handler, second.handler = sealed(stop=0, fail=True), sealed()
    with Client([first.address, second.address]) as client:
        assert client.complete("Hi", timeout=RPC_TIMEOUT_S).text == "Hello world"
    assert second.requests == first.requests  # no resume field: nothing was received


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("stop", [0, 2])
def test_a_call_the_router_cancelled_goes_on_on_the_next_router(
        kind: str, stop: int, fakes: list[FakeGeneration]) -> None:
    """A router that stops cancels the calls that reached it as its port closed
    (grpc/grpc#41785): not the client's doing, so the stream goes on elsewhere."""
    first, second = fakes
    first.handler = sealed(stop=stop, fail=True, code=grpc.StatusCode.CANCELLED)
    second.handler = sealed(start=stop)
    addresses = [first.address, second.address]
    if kind == "sync":
        with Client(addresses) as client:
            result = client.complete("Hi", max_tokens=8, timeout=RPC_TIMEOUT_S)
    else:
        async def main() -> Any:
            async with AsyncClient(addresses) as client:
                return await client.complete("Hi", max_tokens=8, timeout=RPC_TIMEOUT_S)
        result = asyncio.run(main())
    assert list(result.token_ids) == [11, 12, 13, 14, 15, 16]
    assert len(first.requests) == len(second.requests) == 1
    assert second.requests[0].HasField("resume") == (stop > 0)


def test_resumes_are_bounded_and_can_be_turned_off(fakes: list[FakeGeneration]) -> None:
    first, second = fakes
    first.handler = second.handler = sealed(stop=0, fail=True)
    with Client([first.address, second.address], max_resumes=2) as client:
        with pytest.raises(PdserveError) as caught:
            client.complete("Hi", timeout=RPC_TIMEOUT_S)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(first.requests) + len(second.requests) == 3  # the call and 2 more
    first.handler = sealed(stop=1, fail=True)
    with Client([first.address, second.address], max_resumes=0) as client:
        with pytest.raises(PdserveError):
            client.complete("Hi", timeout=RPC_TIMEOUT_S)
    assert len(second.requests) == 1  # untouched by the second client


def test_other_errors_and_a_stream_that_does_not_go_on_where_it_broke_are_raised(
        fakes: list[FakeGeneration]) -> None:
    first, second = fakes
    first.handler = sealed(stop=2, fail=True)
    second.handler = sealed(start=3)  # skips message 2: tokens 14, 15 would be missing
    with Client([first.address, second.address]) as client:
        with pytest.raises(PdserveError) as caught:
            client.complete("Hi", timeout=RPC_TIMEOUT_S)
        assert caught.value.code == grpc.StatusCode.INTERNAL
        assert "went on at token 5, not 3" in caught.value.details

        def invalid(request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
                    ) -> Iterator[generate_pb2.GenerateResponse]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
            yield from ()

        first.handler = second.handler = invalid
        before = len(first.requests) + len(second.requests)
        with pytest.raises(PdserveError) as caught:
            client.complete("Hi", timeout=RPC_TIMEOUT_S)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert len(first.requests) + len(second.requests) == before + 1


def test_addresses_must_be_given() -> None:
    with pytest.raises(ValueError, match="router address"):
        Client([])


def test_a_failure_after_the_last_message_is_no_failure(fakes: list[FakeGeneration]) -> None:
    first, second = fakes
    first.handler, second.handler = sealed(fail=True), sealed()  # whole, then UNAVAILABLE
    with Client([first.address, second.address]) as client:
        result = client.complete("Hi", timeout=RPC_TIMEOUT_S)

        async def main() -> str:
            async with AsyncClient([first.address, second.address]) as aio:
                return (await aio.complete("Hi", timeout=RPC_TIMEOUT_S)).text

        assert asyncio.run(main()) == "Hello world"
    assert result.text == "Hello world" and result.finish_reason == "length"
    assert second.requests == []  # nothing resumed


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_router_back_on_its_port_is_reached_at_once(
        kind: str, fakes: list[FakeGeneration], servers: list[grpc.Server]) -> None:
    """A rolling restart: the first router goes down and comes back on its port; then the
    second goes down. The first's channel, still backing off from its failed reconnects,
    gets a moment to connect: no call fails."""
    first, second = fakes
    first.handler = second.handler = sealed()
    port = int(first.address.rsplit(":", 1)[1])

    async def calls(client: Client | AsyncClient, n: int) -> list[str]:
        if isinstance(client, AsyncClient):
            return [(await client.complete("Hi", timeout=RPC_TIMEOUT_S)).text for _ in range(n)]
        return [client.complete("Hi", timeout=RPC_TIMEOUT_S).text for _ in range(n)]

    async def main() -> list[str]:
        addresses = [first.address, second.address]
        client = Client(addresses) if kind == "sync" else AsyncClient(addresses)
        try:
            texts = await calls(client, 2)  # both channels connected
            servers[0].stop(grace=None).wait(5)
            texts += await calls(client, 4)  # the first refuses: every call on the second
            servers.append(serve(first, port))  # back, on the same port
            second.handler = sealed(stop=0, fail=True)  # the second shuts down
            texts += await calls(client, 4)  # every call ends on the first
            return texts
        finally:
            if isinstance(client, AsyncClient):
                await client.close()
            else:
                client.close()

    assert asyncio.run(main()) == ["Hello world"] * 10


def test_with_n_choices_a_failure_after_the_first_choice_ended_is_raised(
        fakes: list[FakeGeneration]) -> None:
    """Every choice ends with a finish_reason; only the stream's last message (usage) ends
    the stream: a failure before it is the call's failure, not a short stream."""
    first, second = fakes

    def choice_zero_then_fail(request: generate_pb2.GenerateRequest,
                              context: grpc.ServicerContext
                              ) -> Iterator[generate_pb2.GenerateResponse]:
        yield generate_pb2.GenerateResponse(request_id="r", token_ids=[11], text="a",
                                            finish_reason="length", index=0)
        yield generate_pb2.GenerateResponse(request_id="r", token_ids=[12], text="b", index=1)
        context.abort(grpc.StatusCode.UNAVAILABLE, "Stream removed")

    first.handler = second.handler = choice_zero_then_fail
    with Client([first.address, second.address]) as client:
        with pytest.raises(PdserveError) as caught:
            client.complete("Hi", n=2, timeout=RPC_TIMEOUT_S)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(PdserveError):
            list(client.generate("Hi", n=2, timeout=RPC_TIMEOUT_S))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_closing_the_client_during_a_failovers_wait_ends_the_stream_cancelled(
        kind: str, fakes: list[FakeGeneration], monkeypatch: pytest.MonkeyPatch) -> None:
    """``close()`` while a broken stream waits to go on: ``PdserveError(CANCELLED)``, as
    documented (grpc's own closed-channel error escaped, a ValueError or a UsageError)."""
    import threading

    from pdserve import failover

    monkeypatch.setattr(failover, "BACKOFF_S", 1.0)  # a wait of 0.5-1 s to close during
    first, second = fakes
    first.handler, second.handler = sealed(stop=1, fail=True), sealed(start=1)
    addresses = [first.address, second.address]
    if kind == "sync":
        client = Client(addresses)
        stream = client.generate("Hi", max_tokens=8, timeout=RPC_TIMEOUT_S)
        next(stream)
        threading.Timer(0.2, client.close).start()
        with pytest.raises(PdserveError) as info:
            list(stream)
    else:
        async def main() -> None:
            client = AsyncClient(addresses)
            stream = client.generate("Hi", max_tokens=8, timeout=RPC_TIMEOUT_S)
            await stream.__anext__()
            closing = asyncio.get_running_loop().call_later(
                0.2, lambda: asyncio.ensure_future(client.close()))
            try:
                async for _ in stream:
                    pass
            finally:
                closing.cancel()
                await client.close()

        with pytest.raises(PdserveError) as info:
            asyncio.run(main())
    assert info.value.code is grpc.StatusCode.CANCELLED, info.value
    assert second.requests == []  # nothing went on
