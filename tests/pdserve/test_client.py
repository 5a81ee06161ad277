"""Unit tests of the client SDK (``pdserve.Client``, ``pdserve.AsyncClient``).

``FakeGeneration`` is a test double of the router's public ``pdserve.v1.Generation``
service: a real gRPC server on 127.0.0.1 (ephemeral port) inside this test process that
records every request it receives and answers with whatever the test scripts (a
``Handler``). It checks nothing itself; the real router is tested end to end elsewhere.
Every RPC here carries a deadline, and every scripted wait on the server side ends by
itself after ``HANG_S``, so a broken cancellation fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import pytest

import pdserve
from pdserve import AsyncClient, Client, Completion, GenerationChunk, PdserveError, Usage
from pdserve.v1 import generate_pb2_grpc
from tests.pdserve.fake_generation import (
    CANCEL_SEEN_S,
    DELTAS,
    RPC_TIMEOUT_S,
    FakeGeneration,
    abort,
    hang,
    stream_of,
)

T = TypeVar("T")

@pytest.fixture
def fake() -> Iterator[FakeGeneration]:
    """A started ``FakeGeneration`` on 127.0.0.1 (stopped afterwards)."""
    servicer = FakeGeneration()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    server.stop(grace=None).wait(5)


@pytest.fixture
def client(fake: FakeGeneration) -> Iterator[Client]:
    with Client(fake.address) as c:
        yield c


def keep_calls(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Keeps every ``Generate`` call object of ``client`` referenced (in the returned list).

    gRPC cancels a call object when it is garbage-collected; holding it makes a test show
    that the SDK cancels the call itself, as an application holding it would need.
    """
    calls: list[Any] = []
    start_call = client._stubs[0].Generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(start_call(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(client._stubs[0], "Generate", spy)
    return calls


def run_async(address: str, body: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """Runs ``body(client)`` on a fresh event loop with an ``AsyncClient`` of ``address``."""
    async def main() -> T:
        async with AsyncClient(address) as c:
            return await asyncio.wait_for(body(c), 2 * RPC_TIMEOUT_S)
    return asyncio.run(main())


def expected_chunks(request_id: str) -> list[GenerationChunk]:
    return [GenerationChunk(request_id, (11, 12), "Hello"),
            GenerationChunk(request_id, (13,), ""),
            GenerationChunk(request_id, (14,), " wörld", "length", Usage(5, 4, 2))]


def expected_completion(request_id: str) -> Completion:
    return Completion(request_id, (11, 12, 13, 14), "Hello wörld", "length", Usage(5, 4, 2))


# 1. Responses map into chunks and completions.

def test_generate_streams_chunks(client: Client) -> None:
    chunks = list(client.generate("hi", timeout=RPC_TIMEOUT_S))
    assert chunks == expected_chunks("srv-1")
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert [c.usage for c in chunks] == [None, None, Usage(5, 4, 2)]


def test_complete_concatenates_chunks(client: Client) -> None:
    assert client.complete("hi", timeout=RPC_TIMEOUT_S) == expected_completion("srv-1")
    result = client.complete("hi", request_id="req-7", timeout=RPC_TIMEOUT_S)
    assert result == expected_completion("req-7")


def test_async_generate_and_complete(fake: FakeGeneration) -> None:
    async def body(c: AsyncClient) -> tuple[list[GenerationChunk], Completion]:
        chunks = [chunk async for chunk in c.generate("hi", timeout=RPC_TIMEOUT_S)]
        return chunks, await c.complete("hi", request_id="req-8", timeout=RPC_TIMEOUT_S)

    chunks, result = run_async(fake.address, body)
    assert chunks == expected_chunks("srv-1")
    assert result == expected_completion("req-8")


def test_complete_without_final_message_is_an_error(fake: FakeGeneration, client: Client
                                                    ) -> None:
    fake.handler = stream_of(DELTAS, final=False)
    with pytest.raises(PdserveError) as sync_error:
        client.complete("hi", timeout=RPC_TIMEOUT_S)
    with pytest.raises(PdserveError) as async_error:
        run_async(fake.address, lambda c: c.complete("hi", timeout=RPC_TIMEOUT_S))
    assert sync_error.value.code == async_error.value.code == grpc.StatusCode.INTERNAL


# 2. Arguments map into the request exactly; the server validates them, not the client.

def test_every_argument_reaches_the_request(fake: FakeGeneration, client: Client) -> None:
    args: dict[str, Any] = dict(
        prompt_token_ids=[3, 1, 4], max_tokens=7, temperature=0.25, top_p=0.5, top_k=40,
        seed=1234, stop=["\n", "END"], stop_token_ids=[9, 8], ignore_eos=True,
        request_id="req-1", model="tiny-llama", timeout=RPC_TIMEOUT_S)
    client.complete(**args)
    list(client.generate(**args))
    run_async(fake.address, lambda c: c.complete(**args))
    request, *others = fake.requests
    assert others == [request, request]  # every entry point forwards every argument
    assert request.WhichOneof("prompt") == "token_ids"
    assert list(request.token_ids.ids) == [3, 1, 4]
    assert (request.request_id, request.model) == ("req-1", "tiny-llama")
    sampling = request.sampling
    for field in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert sampling.HasField(field), field
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (7, 0.25, 0.5)
    assert (sampling.top_k, sampling.seed, sampling.ignore_eos) == (40, 1234, True)
    assert list(sampling.stop) == ["\n", "END"]
    assert list(sampling.stop_token_ids) == [9, 8]


def test_defaults_are_sent_and_seed_only_when_given(fake: FakeGeneration, client: Client
                                                    ) -> None:
    client.complete("hi", timeout=RPC_TIMEOUT_S)
    client.complete("hi", seed=0, stop="\n", timeout=RPC_TIMEOUT_S)
    default, seeded = fake.requests
    assert default.WhichOneof("prompt") == "text" and default.text == "hi"
    assert (default.request_id, default.model) == ("", "")
    sampling = default.sampling
    for field in ("max_tokens", "temperature", "top_p", "top_k"):
        assert sampling.HasField(field), field
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (
        16, 1.0, 1.0, -1)
    assert not sampling.HasField("seed")
    assert (list(sampling.stop), list(sampling.stop_token_ids), sampling.ignore_eos) == (
        [], [], False)
    assert seeded.sampling.HasField("seed") and seeded.sampling.seed == 0
    assert list(seeded.sampling.stop) == ["\n"]  # one string is one stop string


def test_out_of_range_values_are_left_to_the_server(fake: FakeGeneration, client: Client
                                                    ) -> None:
    client.complete("hi", temperature=-1.0, top_p=2.0, max_tokens=0, timeout=RPC_TIMEOUT_S)
    client.complete(prompt_token_ids=[], timeout=RPC_TIMEOUT_S)
    bad_sampling, empty_prompt = fake.requests
    assert (bad_sampling.sampling.temperature, bad_sampling.sampling.top_p) == (-1.0, 2.0)
    assert bad_sampling.sampling.max_tokens == 0
    assert empty_prompt.WhichOneof("prompt") == "token_ids"  # set, though empty


@pytest.mark.parametrize("prompts", [{}, {"prompt": "hi", "prompt_token_ids": [1]}],
                         ids=["neither", "both"])
def test_prompt_choice_is_checked_locally(fake: FakeGeneration, client: Client,
                                          prompts: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        client.generate(**prompts, timeout=RPC_TIMEOUT_S)  # raised before iterating
    with pytest.raises(ValueError, match="exactly one"):
        client.complete(**prompts, timeout=RPC_TIMEOUT_S)

    async def body(c: AsyncClient) -> None:
        with pytest.raises(ValueError, match="exactly one"):
            c.generate(**prompts, timeout=RPC_TIMEOUT_S)
        with pytest.raises(ValueError, match="exactly one"):
            await c.complete(**prompts, timeout=RPC_TIMEOUT_S)

    run_async(fake.address, body)
    assert fake.requests == []


# 3. Failures surface as PdserveError with the status code.

@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_server_error_carries_its_code(fake: FakeGeneration, client: Client,
                                       code: grpc.StatusCode) -> None:
    fake.handler = abort(code, "top_p must be in (0, 1]")
    fake.info_error = (code, "top_p must be in (0, 1]")

    async def async_generate(c: AsyncClient) -> None:
        async for _ in c.generate("hi", timeout=RPC_TIMEOUT_S):
            pass

    calls: list[Callable[[], object]] = [
        lambda: list(client.generate("hi", timeout=RPC_TIMEOUT_S)),
        lambda: client.complete("hi", timeout=RPC_TIMEOUT_S),
        lambda: client.model_info(timeout=RPC_TIMEOUT_S),
        lambda: run_async(fake.address, async_generate),
        lambda: run_async(fake.address, lambda c: c.complete("hi", timeout=RPC_TIMEOUT_S)),
        lambda: run_async(fake.address, lambda c: c.model_info(timeout=RPC_TIMEOUT_S)),
    ]
    for call in calls:
        with pytest.raises(PdserveError) as error:
            call()
        assert (error.value.code, error.value.details) == (code, "top_p must be in (0, 1]")
        assert str(error.value) == f"{code.name}: top_p must be in (0, 1]"


def test_error_after_some_chunks(fake: FakeGeneration, client: Client) -> None:
    fake.handler = abort(grpc.StatusCode.UNAVAILABLE, "decode worker died", chunks_first=2)
    received = []
    with pytest.raises(PdserveError) as error:
        for chunk in client.generate("hi", timeout=RPC_TIMEOUT_S):
            received.append(chunk.token_ids)
    assert received == [(0,), (1,)]
    assert error.value.code == grpc.StatusCode.UNAVAILABLE

    async def body(c: AsyncClient) -> list[tuple[int, ...]]:
        got = []
        with pytest.raises(PdserveError) as error:
            async for chunk in c.generate("hi", timeout=RPC_TIMEOUT_S):
                got.append(chunk.token_ids)
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        return got

    assert run_async(fake.address, body) == [(0,), (1,)]


def test_timeout_is_the_call_deadline(fake: FakeGeneration, client: Client) -> None:
    fake.handler = hang(fake, first_chunk=True)
    with pytest.raises(PdserveError) as sync_error:
        client.complete("hi", timeout=0.5)
    assert sync_error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.saw_cancel.wait(CANCEL_SEEN_S)

    fake.saw_cancel.clear()
    with pytest.raises(PdserveError) as async_error:
        run_async(fake.address, lambda c: c.complete("hi", timeout=0.5))
    assert async_error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.saw_cancel.wait(CANCEL_SEEN_S)


def test_unreachable_server_is_unavailable() -> None:
    with Client("127.0.0.1:1") as c, pytest.raises(PdserveError) as error:
        c.complete("hi", timeout=RPC_TIMEOUT_S)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


# 4. Leaving a stream early cancels the call on the server. Each way of leaving returns
# what the application would still hold, so only the SDK's own cancel can free the call.

def close_generator(fake: FakeGeneration, client: Client) -> object:
    chunks = client.generate("hi", timeout=RPC_TIMEOUT_S)
    assert next(chunks).token_ids == (1,)
    assert not fake.saw_cancel.wait(0.2)  # still running while the stream is open
    chunks.close()
    return chunks


def break_for_loop(fake: FakeGeneration, client: Client) -> object:
    for chunk in client.generate("hi", timeout=RPC_TIMEOUT_S):
        assert chunk.token_ids == (1,)
        break  # the loop held the generator's only reference
    return None


@pytest.mark.parametrize("leave", [close_generator, break_for_loop])
def test_leaving_the_generator_cancels_the_call(
        fake: FakeGeneration, client: Client, monkeypatch: pytest.MonkeyPatch,
        leave: Callable[[FakeGeneration, Client], object]) -> None:
    fake.handler = hang(fake, first_chunk=True)
    calls = keep_calls(client, monkeypatch)
    kept = leave(fake, client)
    gc.collect()
    assert fake.saw_cancel.wait(CANCEL_SEEN_S)
    assert len(calls) == 1
    del kept


async def aclose_stream(c: AsyncClient) -> object:
    stream = c.generate("hi", timeout=RPC_TIMEOUT_S)
    assert (await anext(stream)).token_ids == (1,)
    await stream.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(stream)
    return stream


async def break_async_for(c: AsyncClient) -> object:
    async for chunk in c.generate("hi", timeout=RPC_TIMEOUT_S):
        assert chunk.token_ids == (1,)
        break  # the loop held the stream's only reference
    return None


async def cancel_reading_task(c: AsyncClient) -> object:
    stream = c.generate("hi", timeout=RPC_TIMEOUT_S)
    await anext(stream)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.1)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    return stream


async def aclose_from_another_task(c: AsyncClient) -> object:
    stream = c.generate("hi", timeout=RPC_TIMEOUT_S)
    await anext(stream)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.1)
    await stream.aclose()
    with pytest.raises(PdserveError) as error:
        await pending
    assert error.value.code == grpc.StatusCode.CANCELLED
    return stream


@pytest.mark.parametrize("leave", [aclose_stream, break_async_for, cancel_reading_task,
                                   aclose_from_another_task])
def test_leaving_an_async_stream_cancels_the_call(
        fake: FakeGeneration, leave: Callable[[AsyncClient], Awaitable[object]]) -> None:
    fake.handler = hang(fake, first_chunk=True)

    async def body(c: AsyncClient) -> bool:
        kept = await leave(c)
        seen = await asyncio.to_thread(fake.saw_cancel.wait, CANCEL_SEEN_S)
        del kept
        return seen

    assert run_async(fake.address, body)


def test_closing_the_client_fails_running_calls(fake: FakeGeneration) -> None:
    fake.handler = hang(fake, first_chunk=True)
    client = Client(fake.address)
    chunks = client.generate("hi", timeout=RPC_TIMEOUT_S)
    next(chunks)
    client.close()
    with pytest.raises(PdserveError) as sync_error:
        next(chunks)
    assert sync_error.value.code == grpc.StatusCode.CANCELLED
    assert fake.saw_cancel.wait(CANCEL_SEEN_S)

    fake.saw_cancel.clear()

    async def body() -> PdserveError:
        c = AsyncClient(fake.address)
        stream = c.generate("hi", timeout=RPC_TIMEOUT_S)
        await anext(stream)
        pending = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)
        await c.close()
        with pytest.raises(PdserveError) as error:
            await asyncio.wait_for(pending, RPC_TIMEOUT_S)
        return error.value

    assert asyncio.run(body()).code == grpc.StatusCode.CANCELLED
    assert fake.saw_cancel.wait(CANCEL_SEEN_S)


# 5. Model info, the package surface.

def test_model_info(fake: FakeGeneration, client: Client) -> None:
    expected = pdserve.ModelInfo(model="tiny-llama", context_length=256, vocab_size=512,
                                 eos_token_ids=(2, 7), block_size=16)
    assert client.model_info(timeout=RPC_TIMEOUT_S) == expected
    assert run_async(fake.address, lambda c: c.model_info(timeout=RPC_TIMEOUT_S)) == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        expected.vocab_size = 1  # type: ignore[misc]


def test_import_pdserve_loads_neither_grpc_nor_torch() -> None:
    code = ("import sys, pdserve\n"
            "assert 'grpc' not in sys.modules\n"
            "pdserve.Client, pdserve.AsyncClient, pdserve.PdserveError\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print(pdserve.Client.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "pdserve.client"


def test_package_exports() -> None:
    for name in pdserve.__all__:
        assert getattr(pdserve, name) is not None
    assert pdserve.AsyncClient.__module__ == "pdserve.aio_client"
    assert isinstance(pdserve.__version__, str)
    with pytest.raises(AttributeError):
        pdserve.NoSuchThing  # noqa: B018
