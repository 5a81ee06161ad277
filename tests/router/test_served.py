"""``ServedRequest``'s buffer towards its client: chunks that waited while the client was
behind leave as one (tokens, text and logprobs in order, the last one's finish and usage),
never across the end of the stream; a client that keeps up gets every chunk as it was.
The handoff is a fake (``stream()`` only); admission and metrics are the real ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from engine.sampling_params import TokenLogprobs
from router.admission import Admission
from router.errors import RouteError
from router.metrics import RouterMetrics
from router.outputs import OutputChunk, Usage, merge_chunks
from router.served import ServedRequest


def _lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5 * token, 1, ())


def _chunks(n: int, *, fail: bool = False) -> list[OutputChunk]:
    chunks = [OutputChunk((i,), f"t{i} ", logprobs=(_lp(i),), worker_s=0.1 if i == 0 else None)
              for i in range(n)]
    if not fail:
        chunks[-1] = OutputChunk((n - 1,), f"t{n - 1} ", "length", Usage(3, n, 0),
                                 logprobs=(_lp(n - 1),))
    return chunks


class FakeHandoff:
    """Its chunks at once (no await between them: they wait while the reader is away)."""

    def __init__(self, chunks: list[OutputChunk], fail: bool = False) -> None:
        self._chunks, self._fail = chunks, fail

    async def stream(self) -> AsyncGenerator[OutputChunk, None]:
        for chunk in self._chunks:
            yield chunk
        if self._fail:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, "the workers failed")


def _served(handoff: FakeHandoff, admission: Admission) -> ServedRequest:
    request: Any = SimpleNamespace(request_id="r", n=1)
    return ServedRequest(request, admission.enter("r", 3), 1e9, 0.0, lambda trace: handoff,
                         metrics=RouterMetrics(), max_buffered_chunks=64)


def test_merge_chunks_keeps_order_and_takes_the_last_finish() -> None:
    chunks = _chunks(4)
    merged = merge_chunks(chunks)
    assert merged.token_ids == (0, 1, 2, 3) and merged.text == "t0 t1 t2 t3 "
    assert [lp.token_id for lp in merged.logprobs] == [0, 1, 2, 3]
    assert merged.finish_reason == "length" and merged.usage == Usage(3, 4, 0)
    assert merged.worker_s == 0.1
    assert merge_chunks(chunks[:1]) is chunks[0]


def test_chunks_that_waited_for_the_client_go_as_one_message() -> None:
    async def run() -> tuple[list[OutputChunk], int]:
        admission = Admission(8, None)
        served = _served(FakeHandoff(_chunks(10)), admission)
        got: list[OutputChunk] = []
        async for chunk in served.chunks():
            got.append(chunk)
        return got, admission.inflight

    got, inflight = asyncio.run(run())
    assert len(got) == 1, got  # all ten waited before the client first asked
    assert [t for c in got for t in c.token_ids] == list(range(10))
    assert "".join(c.text for c in got) == "".join(f"t{i} " for i in range(10))
    assert [lp.token_id for c in got for lp in c.logprobs] == list(range(10))
    assert got[-1].finish_reason == "length" and got[-1].usage == Usage(3, 10, 0)
    assert inflight == 0


def test_a_failure_behind_waiting_chunks_comes_after_them_merged() -> None:
    async def run() -> tuple[list[OutputChunk], RouteError | None, int]:
        admission = Admission(8, None)
        served = _served(FakeHandoff(_chunks(5, fail=True), fail=True), admission)
        got: list[OutputChunk] = []
        try:
            async for chunk in served.chunks():
                got.append(chunk)
        except RouteError as exc:
            return got, exc, admission.inflight
        return got, None, admission.inflight

    got, error, inflight = asyncio.run(run())
    assert error is not None and error.code == grpc.StatusCode.UNAVAILABLE
    assert [t for c in got for t in c.token_ids] == list(range(5)) and len(got) == 1
    assert all(c.finish_reason is None for c in got) and inflight == 0


@pytest.mark.parametrize("n", [1, 7])
def test_a_client_that_keeps_up_gets_every_chunk_as_it_came(n: int) -> None:
    class Paced(FakeHandoff):
        async def stream(self) -> AsyncGenerator[OutputChunk, None]:
            for chunk in self._chunks:
                yield chunk
                await asyncio.sleep(0.002)  # the reader is waiting for each

    async def run() -> list[OutputChunk]:
        served = _served(Paced(_chunks(n)), Admission(8, None))
        return [chunk async for chunk in served.chunks()]

    assert asyncio.run(run()) == _chunks(n)
