"""The asyncio twin of ``pdserve.Client``, on ``grpc.aio``.

    async with pdserve.AsyncClient("localhost:50051") as client:
        async for chunk in client.generate("The capital of France is", max_tokens=8):
            print(chunk.text, end="", flush=True)
        result = await client.complete(prompt_token_ids=[1, 2, 3], temperature=0.0)

Result types, ``PdserveError`` and the proto mapping are those of ``pdserve.client``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import grpc
import grpc.aio

from pdserve.client import (
    ChannelOptions,
    Completion,
    CompletionBuilder,
    GenerationChunk,
    LogitsOptions,
    ModelInfo,
    PdserveError,
    auth_metadata,
    build_request,
    chunk_from_response,
    error_from_rpc,
    model_info_from_proto,
    open_channels,
)
from pdserve.failover import (
    CLOSED,
    DEFAULT_MAX_RESUMES,
    RouterTurns,
    StreamProgress,
    as_addresses,
)
from pdserve.v1 import generate_pb2, generate_pb2_grpc

__all__ = ["AsyncClient", "AsyncGenerationStream"]


class AsyncGenerationStream:
    """The chunks of one ``Generate`` call, as an async iterator (``async for``).

    The call starts at the first ``__anext__``. Failures raise ``PdserveError`` from it.
    The call is cancelled, so the server frees the request, when the stream is closed
    (``aclose()`` / ``cancel()``, or ``async with`` around it), when the task awaiting a
    chunk is cancelled, or when the stream is garbage-collected unfinished (e.g. after
    ``break`` in an ``async for`` that held the only reference). After closing, iteration
    stops; a chunk awaited by another task at that moment, or while the client is
    closed, raises ``PdserveError(CANCELLED)``.
    """

    def __init__(self, stubs: Sequence[generate_pb2_grpc.GenerationStub],
                 request: generate_pb2.GenerateRequest, timeout: float | None,
                 metadata: tuple[tuple[str, str], ...] | None = None, *,
                 turns: RouterTurns | None = None,
                 max_resumes: int = DEFAULT_MAX_RESUMES,
                 channels: Sequence[grpc.aio.Channel] | None = None,
                 client_closed: Callable[[], bool] = lambda: False) -> None:
        self._stubs = stubs
        self._client_closed = client_closed  # whether its client closed the channels
        self._channels = channels  # the stubs' channels (None: no wait for one to connect)
        self._turns = turns or RouterTurns(len(stubs))
        self._router = self._turns.first()
        self._metadata = metadata
        self._progress = StreamProgress(request, timeout, max_resumes)
        self._call: Any = None  # grpc.aio.UnaryStreamCall once started
        self._finished = False
        self._closed = False

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._finished or self._closed:
            raise StopAsyncIteration
        while True:
            if self._call is None:
                if self._client_closed():  # close() during a failover's wait
                    self._finished = True
                    raise PdserveError(grpc.StatusCode.CANCELLED, CLOSED)
                progress = self._progress
                self._call = self._stubs[self._router].Generate(
                    progress.next_request(), timeout=progress.timeout(),
                    metadata=self._metadata)
            try:
                response = await self._read()
            except grpc.RpcError as error:  # the stream goes on on the next router, or fails
                if self._progress.finished:  # the last message arrived: the stream is whole
                    self._finished = True
                    raise StopAsyncIteration from None
                closed = self._closed or self._client_closed()
                if self._closed or not self._progress.may_go_on(error, closed=closed):
                    self._finished = True
                    raise error_from_rpc(error) from None
                self._call = None
                self._router = self._turns.after(self._router)
                await asyncio.sleep(self._progress.backoff_s())
                await self._await_ready(self._router)
                continue
            if response is grpc.aio.EOF:
                self._finished = True
                raise StopAsyncIteration
            try:
                self._progress.received(response)
            except ValueError as exc:
                self.cancel()
                raise PdserveError(grpc.StatusCode.INTERNAL, str(exc)) from None
            return chunk_from_response(response)

    async def _await_ready(self, router: int) -> None:
        """A moment for ``router``'s channel to connect (it may be reconnecting to a router
        that restarted); one still down is called anyway and fails fast, as one more try."""
        if self._channels is None:
            return
        try:
            await asyncio.wait_for(self._channels[router].channel_ready(),
                                   self._progress.ready_wait_s())
        except TimeoutError:
            pass
        except Exception:  # noqa: BLE001 - grpc's UsageError: close() during the wait
            if not (self._closed or self._client_closed()):
                raise
            self._finished = True
            raise PdserveError(grpc.StatusCode.CANCELLED, CLOSED) from None

    async def _read(self) -> Any:
        """The current call's next message (or EOF); a cancel under this task is
        ``PdserveError(CANCELLED)``, this task's own cancel cancels the call."""
        try:
            return await self._call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                # The call was cancelled under this task (stream or client closed).
                self._finished = True
                raise PdserveError(grpc.StatusCode.CANCELLED,
                                   "the stream or its client was closed") from None
            self.cancel()
            raise

    def cancel(self) -> None:
        """Cancels the call (a no-op once it has ended) and ends the iteration."""
        self._closed = True
        if self._call is not None and not self._finished:
            self._call.cancel()

    async def aclose(self) -> None:
        """Same as ``cancel()``, awaitable like an async generator's ``aclose``."""
        self.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None and not self._finished:
            self._call.cancel()


class AsyncClient:
    """An asyncio client of a pdserve cluster's routers: ``address`` is one
    (``"host:port"``) or a list of them, used in turn, a broken stream resumed on the
    next one (up to ``max_resumes`` times per call), as by ``Client``.

    Create it inside the event loop that will use it (a ``grpc.aio`` channel belongs to
    one loop). ``api_key``, ``tls``, ``root_certificates`` and ``options`` as for
    ``Client``. Use ``async with`` or
    ``await close()``. Every call failure raises ``PdserveError``.
    """

    def __init__(self, address: str | Sequence[str], *, api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 options: ChannelOptions = (), max_resumes: int = DEFAULT_MAX_RESUMES) -> None:
        self.addresses = as_addresses(address)
        self.address = self.addresses[0]
        self.max_resumes = max_resumes
        self._channels = open_channels(grpc.aio, self.addresses, tls, root_certificates,
                                       options)
        self._stubs = [generate_pb2_grpc.GenerationStub(c) for c in self._channels]
        self._turns = RouterTurns(len(self._stubs))
        self._metadata = auth_metadata(api_key)
        self.closed = False  # close() was called

    def generate(
        self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
        seed: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
        request_id: str | None = None, model: str | None = None, timeout: float | None = None,
        **logits: Unpack[LogitsOptions],
    ) -> AsyncGenerationStream:
        """Streams the completion of one prompt: ``async for chunk in client.generate(...)``.

        Not a coroutine: it checks the arguments (``ValueError`` unless exactly one of
        ``prompt`` / ``prompt_token_ids`` is given, raised here before any network use)
        and returns an ``AsyncGenerationStream``. Arguments, chunks, cancellation and
        errors as for ``Client.generate``; ``timeout`` (seconds) bounds the whole call.
        """
        request = build_request(
            prompt, prompt_token_ids, max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, request_id=request_id, model=model, logits=logits)
        return AsyncGenerationStream(self._stubs, request, timeout, self._metadata,
                                     turns=self._turns, max_resumes=self.max_resumes,
                                     channels=self._channels,
                                     client_closed=lambda: self.closed)

    async def complete(
        self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
        seed: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
        request_id: str | None = None, model: str | None = None, timeout: float | None = None,
        **logits: Unpack[LogitsOptions],
    ) -> Completion:
        """Generates to the end and returns the whole ``Completion``.

        Arguments and errors as for ``generate``; cancelling the awaiting task cancels
        the call.
        """
        stream = self.generate(
            prompt, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, request_id=request_id,
            model=model, timeout=timeout, **logits)
        builder = CompletionBuilder()
        async with stream:
            async for chunk in stream:
                builder.add(chunk)
        return builder.result()

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and its limits; ``PdserveError`` on failure."""
        try:
            info = await self._stubs[self._turns.first()].GetModelInfo(
                generate_pb2.ModelInfoRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
        return model_info_from_proto(info)

    async def close(self) -> None:
        """Closes the channels; calls still running fail with ``PdserveError(CANCELLED)``."""
        self.closed = True
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
