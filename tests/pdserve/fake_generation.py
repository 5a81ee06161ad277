"""A test double of the router's public ``pdserve.v1.Generation`` service.

``FakeGeneration`` is a real gRPC servicer (served on 127.0.0.1 by the tests' fixture)
that records every request it receives and answers with whatever the test scripts (a
``Handler``). It checks nothing itself; the real router is tested end to end in
``tests/router``. Every scripted wait ends by itself after ``HANG_S``, so a broken
cancellation fails a test instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc

from pdserve.v1 import generate_pb2, generate_pb2_grpc

Handler = Callable[[generate_pb2.GenerateRequest, grpc.ServicerContext],
                   Iterator[generate_pb2.GenerateResponse]]

RPC_TIMEOUT_S = 10.0  # deadline of every call that should succeed
HANG_S = 10.0  # a hanging handler gives up after this long
CANCEL_SEEN_S = 5.0  # the server must observe a cancellation within this long
USAGE = generate_pb2.Usage(prompt_tokens=5, completion_tokens=4, cached_tokens=2)
DELTAS = [([11, 12], "Hello"), ([13], ""), ([14], " wörld")]  # a chunk may hold back text


class FakeGeneration(generate_pb2_grpc.GenerationServicer):
    """Test double of the router: records requests, answers with ``self.handler``.

    ``saw_cancel`` is set when a call of a hanging handler ends before the handler gave
    up waiting (the client cancelled, or the deadline passed): either the handler saw
    ``context.is_active()`` turn false, or the termination callback ran first (the
    server abandons a handler that is between two messages when the call ends).
    """

    def __init__(self) -> None:
        self.address = ""
        self.requests: list[generate_pb2.GenerateRequest] = []
        self.saw_cancel = threading.Event()
        self.handler: Handler = stream_of(DELTAS)
        self.info_error: tuple[grpc.StatusCode, str] | None = None  # GetModelInfo fails so

    def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[generate_pb2.GenerateResponse]:
        self.requests.append(request)
        yield from self.handler(request, context)

    def GetModelInfo(self, request: generate_pb2.ModelInfoRequest,
                     context: grpc.ServicerContext) -> generate_pb2.ModelInfo:
        if self.info_error is not None:
            context.abort(*self.info_error)
        return generate_pb2.ModelInfo(model="tiny-llama", context_length=256, vocab_size=512,
                                      eos_token_ids=[2, 7], block_size=16)

    def watch_for_cancel(self, context: grpc.ServicerContext) -> threading.Event:
        """Sets ``saw_cancel`` when the call ends, unless the returned event is set first."""
        gave_up = threading.Event()

        def on_termination() -> None:
            if not gave_up.is_set():
                self.saw_cancel.set()

        context.add_callback(on_termination)
        return gave_up

    def wait_until_inactive(self, context: grpc.ServicerContext, gave_up: threading.Event
                            ) -> None:
        deadline = time.monotonic() + HANG_S
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        if context.is_active():
            gave_up.set()
        else:
            self.saw_cancel.set()


def echoed_id(request: generate_pb2.GenerateRequest) -> str:
    return request.request_id or "srv-1"


def stream_of(deltas: list[tuple[list[int], str]], *, final: bool = True) -> Handler:
    """Streams ``deltas``; the last message has finish_reason "length" and usage."""
    def handler(request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
                ) -> Iterator[generate_pb2.GenerateResponse]:
        for i, (token_ids, text) in enumerate(deltas):
            response = generate_pb2.GenerateResponse(
                request_id=echoed_id(request), token_ids=token_ids, text=text)
            if final and i == len(deltas) - 1:
                response.finish_reason = "length"
                response.usage.CopyFrom(USAGE)
            yield response
    return handler


def hang(fake: FakeGeneration, *, first_chunk: bool) -> Handler:
    """Optionally sends one chunk, then waits until the call is no longer active."""
    def handler(request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
                ) -> Iterator[generate_pb2.GenerateResponse]:
        gave_up = fake.watch_for_cancel(context)
        if first_chunk:
            yield generate_pb2.GenerateResponse(request_id=echoed_id(request), token_ids=[1])
        fake.wait_until_inactive(context, gave_up)
    return handler


def abort(code: grpc.StatusCode, details: str, *, chunks_first: int = 0) -> Handler:
    """Sends ``chunks_first`` chunks, then fails the call with ``code``."""
    def handler(request: generate_pb2.GenerateRequest, context: grpc.ServicerContext
                ) -> Iterator[generate_pb2.GenerateResponse]:
        for i in range(chunks_first):
            yield generate_pb2.GenerateResponse(request_id=echoed_id(request), token_ids=[i])
        context.abort(code, details)
    return handler
