"""The pdserve Python SDK: a blocking client of a cluster's public gRPC API (``pdserve.v1``).

    with pdserve.Client("localhost:50051") as client:
        for chunk in client.generate("The capital of France is", max_tokens=8):
            print(chunk.text, end="", flush=True)
        result = client.complete(prompt_token_ids=[1, 2, 3], temperature=0.0)

The asyncio twin is ``pdserve.AsyncClient`` (``pdserve/aio_client.py``); both share the
result types and the error type (``pdserve.results``, re-exported here) and the proto
mapping defined here. Only the names in
``__all__`` are public; the mapping helpers are shared with ``aio_client`` alone.

The client maps arguments into the request and nothing more: the router validates every
value (ranges, lengths, vocabulary) and answers ``INVALID_ARGUMENT`` naming the limit.
The one local check is that exactly one of ``prompt`` / ``prompt_token_ids`` is given.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

import grpc

from pdserve.failover import (
    CLOSED,
    DEFAULT_MAX_RESUMES,
    RouterTurns,
    StreamProgress,
    as_addresses,
)
from pdserve.results import (
    Completion,
    CompletionBuilder,
    GenerationChunk,
    ModelInfo,
    PdserveError,
    TokenLogprob,
    Usage,
)
from pdserve.v1 import generate_pb2, generate_pb2_grpc

__all__ = ["Client", "Completion", "GenerationChunk", "LogitsOptions", "ModelInfo",
           "PdserveError", "TokenLogprob", "Usage"]

ChannelOptions = Sequence[tuple[str, Any]]

# Responses are small token deltas; the limit only has to exceed the largest ModelInfo.
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries ``api_key`` (``authorization: Bearer KEY``)."""
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


def channel_credentials(tls: bool, root_certificates: bytes | None
                        ) -> grpc.ChannelCredentials | None:
    """TLS credentials (the system's CAs unless ``root_certificates`` PEM is given), or
    None for a plaintext channel (neither ``tls`` nor ``root_certificates``)."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def channel_options(options: ChannelOptions) -> list[tuple[str, Any]]:
    """The SDK's channel options, with ``options`` added (same key: ``options`` wins).
    Keepalive pings every 20 s (within what the router accepts): a router that vanished
    without closing the connection fails the calls on it within about half a minute.
    Reconnects back off from 0.1 s to at most 1 s (gRPC's default grows to 120 s), so a
    router that restarted is reached again within about a second of it being back."""
    merged: dict[str, Any] = {
        "grpc.max_receive_message_length": MAX_RECEIVE_MESSAGE_BYTES,
        "grpc.primary_user_agent": "pdserve-python",
        "grpc.keepalive_time_ms": 20_000,
        "grpc.keepalive_timeout_ms": 10_000,
        "grpc.http2.max_pings_without_data": 0,
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.min_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 1_000,
    }
    merged.update(options)
    return list(merged.items())


class LogitsOptions(TypedDict, total=False):
    """More sampling arguments, named and meant as in vLLM (absent: off): ``min_p``
    (0..1), ``min_tokens`` (EOS and stop token ids held back until that many tokens),
    ``presence_penalty`` and ``frequency_penalty`` (-2..2, over the output),
    ``repetition_penalty`` (> 0, 1 off; over prompt and output), ``logit_bias`` (token
    id → bias, clamped to ±100), ``logprobs`` (0..20: each token's log-probability and
    that many likeliest alternatives, in ``GenerationChunk.logprobs``), ``prompt_logprobs``
    (0..20: the same of each prompt token after the first, given the ones before, on each
    choice's first chunk: ``GenerationChunk.prompt_logprobs``),
    ``structured_outputs`` (what the output must match, one of ``{"json": SCHEMA}`` — a
    dict or JSON text —, ``{"json_object": True}``, ``{"regex": R}``, ``{"choice":
    [S, ...]}``, ``{"grammar": LARK}``; vLLM's), ``n`` (choices, default 1: their chunks
    carry their ``index``; ``complete`` returns choice 0 with every one in ``choices``)."""

    min_p: float
    min_tokens: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float]
    logprobs: int
    prompt_logprobs: int
    structured_outputs: Mapping[str, Any]
    n: int


def open_channels(api: Any, addresses: Sequence[str], tls: bool,
                  root_certificates: bytes | None, options: ChannelOptions) -> list[Any]:
    """A channel per address, of ``api`` (``grpc`` or ``grpc.aio``, which open them the same
    way): TLS as ``channel_credentials`` says, the SDK's ``channel_options``."""
    credentials = channel_credentials(tls, root_certificates)
    merged = channel_options(options)
    return [api.insecure_channel(a, options=merged) if credentials is None
            else api.secure_channel(a, credentials, merged) for a in addresses]


def build_request(
    prompt: str | None, prompt_token_ids: Sequence[int] | None, *, max_tokens: int,
    temperature: float, top_p: float, top_k: int, seed: int | None,
    stop: str | Sequence[str] | None, stop_token_ids: Sequence[int] | None,
    ignore_eos: bool, request_id: str | None, model: str | None,
    logits: LogitsOptions | None = None,
) -> generate_pb2.GenerateRequest:
    """The ``GenerateRequest`` for these arguments (see ``Client.generate``).

    Raises ``ValueError`` unless exactly one of ``prompt`` / ``prompt_token_ids`` is given.
    Every ``optional`` sampling field is set from its argument, ``seed`` only when not
    ``None``; ``stop`` may be one string. Values are not range-checked here.
    """
    if (prompt is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompt (text) or prompt_token_ids")
    sampling = generate_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        stop_token_ids=list(stop_token_ids or ()), ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    for name, value in (logits or {}).items():
        if name == "logit_bias":
            sampling.logit_bias.update({int(k): float(v) for k, v in value.items()})  # type: ignore[attr-defined]
        elif name == "structured_outputs":
            sampling.structured_outputs.CopyFrom(_structured(value))  # type: ignore[arg-type]
        elif name in LogitsOptions.__annotations__:
            setattr(sampling, name, value)
        else:
            raise TypeError(f"unexpected keyword argument {name!r}")
    request = generate_pb2.GenerateRequest(
        request_id=request_id or "", model=model or "", sampling=sampling)
    if prompt is not None:
        request.text = prompt
    else:
        assert prompt_token_ids is not None
        # CopyFrom marks the oneof as set even for an empty list (the router rejects it).
        request.token_ids.CopyFrom(generate_pb2.TokenIds(ids=list(prompt_token_ids)))
    return request


def _structured(value: Mapping[str, Any]) -> generate_pb2.StructuredOutputs:
    """``structured_outputs`` (one kind) as its message (``ValueError`` for another shape)."""
    if not isinstance(value, Mapping) or len(value) != 1:
        raise ValueError("structured_outputs takes one kind: json, json_object, regex, choice "
                         "or grammar")
    ((kind, spec),) = value.items()
    message = generate_pb2.StructuredOutputs()
    if kind == "json":
        message.json = spec if isinstance(spec, str) else json.dumps(spec)
    elif kind == "json_object":
        message.json_object = bool(spec)
    elif kind == "choice":
        if isinstance(spec, str):
            raise ValueError("structured_outputs choice takes a list of strings")
        message.choice.choices.extend(spec)
    elif kind in ("regex", "grammar"):
        setattr(message, kind, spec)
    else:
        raise ValueError(f"structured_outputs has no kind {kind!r}")
    return message


def chunk_from_response(response: generate_pb2.GenerateResponse) -> GenerationChunk:
    """The chunk of one streamed message; the proto's empty ``finish_reason`` → ``None``."""
    usage = None
    if response.HasField("usage"):
        usage = Usage(prompt_tokens=response.usage.prompt_tokens,
                      completion_tokens=response.usage.completion_tokens,
                      cached_tokens=response.usage.cached_tokens)
    return GenerationChunk(request_id=response.request_id, token_ids=tuple(response.token_ids),
                           text=response.text, finish_reason=response.finish_reason or None,
                           usage=usage, index=response.index,
                           logprobs=_logprobs(response.logprobs),
                           prompt_logprobs=_logprobs(response.prompt_logprobs))


def _logprobs(messages: Iterable[generate_pb2.TokenLogprobs]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.logprob, lp.rank, tuple(zip(
        lp.top_token_ids, lp.top_logprobs, strict=True))) for lp in messages)


def model_info_from_proto(info: generate_pb2.ModelInfo) -> ModelInfo:
    """The ``ModelInfo`` dataclass of a ``GetModelInfo`` answer."""
    return ModelInfo(model=info.model, context_length=info.context_length,
                     vocab_size=info.vocab_size, eos_token_ids=tuple(info.eos_token_ids),
                     block_size=info.block_size)


def error_from_rpc(error: grpc.RpcError) -> PdserveError:
    """The ``PdserveError`` of a failed call (sync ``grpc.Call`` errors and ``AioRpcError``)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else None
    return PdserveError(code or grpc.StatusCode.UNKNOWN, details or "")


class Client:
    """A blocking client of a pdserve cluster's routers: ``address`` is one
    (``"host:port"``) or a list of them.

    Calls go to the routers in turn; a stream that breaks (``UNAVAILABLE``: its router
    died or is shutting down, the connection was cut) goes on on the next router, resumed
    after the tokens received — the caller sees one stream, every token once — at most
    ``max_resumes`` times per call (0: a broken stream raises; ``pdserve.failover``).
    Opens a gRPC channel per address (plaintext unless TLS is asked for below; connected
    lazily, on the first call); ``options`` are
    extra channel options (``(key, value)`` pairs, e.g. keepalive settings) that override
    the SDK's defaults. ``api_key``: the router's key (``pdserve router --api-key-file``),
    sent with every call. ``tls=True`` (system CAs) or ``root_certificates`` (PEM bytes
    of the CA to trust) connect with TLS. Use as a context manager or call ``close()``;
    one client is thread-safe and may serve many concurrent calls. Every call failure
    raises ``PdserveError``.
    """

    def __init__(self, address: str | Sequence[str], *, api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 options: ChannelOptions = (), max_resumes: int = DEFAULT_MAX_RESUMES) -> None:
        self.addresses = as_addresses(address)
        self.address = self.addresses[0]
        self.max_resumes = max_resumes
        self._channels = open_channels(grpc, self.addresses, tls, root_certificates, options)
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
    ) -> Generator[GenerationChunk, None, None]:
        """Streams the completion of one prompt as ``GenerationChunk``s.

        Give exactly one of ``prompt`` (text, tokenized by the server) or
        ``prompt_token_ids``, else ``ValueError`` is raised here, before any network use.
        Sampling arguments (and ``LogitsOptions``': penalties, ``min_p``, ``min_tokens``,
        ``logit_bias``) are named and defaulted as in vLLM and checked by the server
        (``PdserveError(INVALID_ARGUMENT)``); ``seed=None`` is unseeded. ``request_id`` is
        sent when given (the server generates one otherwise); ``model``, when given, must
        name the served model. ``timeout`` (seconds) is the deadline of the whole call.

        The call starts at the first ``next()``. The last chunk has ``finish_reason`` and
        ``usage``. Closing the returned generator early (``close()``, leaving a ``for``
        loop over it, garbage collection) cancels the call, so the server frees the
        request. Failures raise ``PdserveError`` from the iteration.
        """
        request = build_request(
            prompt, prompt_token_ids, max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos, request_id=request_id, model=model, logits=logits)
        return self._stream(request, timeout)

    def complete(
        self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
        max_tokens: int = 16, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
        seed: int | None = None, stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None, ignore_eos: bool = False,
        request_id: str | None = None, model: str | None = None, timeout: float | None = None,
        **logits: Unpack[LogitsOptions],
    ) -> Completion:
        """Generates to the end and returns the whole ``Completion``.

        Arguments and errors as for ``generate`` (``ValueError`` for a bad prompt choice,
        ``PdserveError`` for every call failure); ``timeout`` bounds the whole call.
        """
        chunks = self.generate(
            prompt, prompt_token_ids=prompt_token_ids, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, request_id=request_id,
            model=model, timeout=timeout, **logits)
        builder = CompletionBuilder()
        with contextlib.closing(chunks):
            for chunk in chunks:
                builder.add(chunk)
        return builder.result()

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and its limits; ``PdserveError`` on failure."""
        try:
            info = self._stubs[self._turns.first()].GetModelInfo(
                generate_pb2.ModelInfoRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
        return model_info_from_proto(info)

    def close(self) -> None:
        """Closes the channels; calls still running fail with ``PdserveError(CANCELLED)``."""
        self.closed = True
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _stream(self, request: generate_pb2.GenerateRequest, timeout: float | None
                ) -> Generator[GenerationChunk, None, None]:
        progress = StreamProgress(request, timeout, self.max_resumes)
        router = self._turns.first()
        while True:
            try:
                call = self._stubs[router].Generate(progress.next_request(),
                                                    timeout=progress.timeout(),
                                                    metadata=self._metadata)
            except ValueError:  # its channel closed: close() during a failover's wait
                raise PdserveError(grpc.StatusCode.CANCELLED, CLOSED) from None
            try:
                for response in call:
                    progress.received(response)
                    yield chunk_from_response(response)
                return
            except grpc.RpcError as error:
                if progress.finished:  # the last message arrived: the stream is whole
                    return
                if not progress.may_go_on(error, closed=self.closed):
                    raise error_from_rpc(error) from None
                time.sleep(progress.backoff_s())
            except ValueError as exc:
                raise PdserveError(grpc.StatusCode.INTERNAL, str(exc)) from None
            finally:
                call.cancel()  # a no-op once the call has ended; frees the server otherwise
            router = self._turns.after(router)
            if self.closed:  # close() during the wait
                raise PdserveError(grpc.StatusCode.CANCELLED, CLOSED)
            # a router that is back, its channel still reconnecting: a moment for it
            ready = grpc.channel_ready_future(self._channels[router])
            try:
                ready.result(timeout=progress.ready_wait_s())
            except grpc.FutureTimeoutError:
                pass  # the call fails fast (UNAVAILABLE) and counts as one more try
            finally:
                ready.cancel()  # (subscribed to the channel for good otherwise)

