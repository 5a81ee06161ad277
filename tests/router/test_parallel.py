"""``router.parallel``: the choices of an ``n`` > 1 request as one stream — seeds seed + i,
chunks tagged with their choice's index, the whole request's usage on the last chunk
only, the later choices started once choice 0's first chunk is out, a failed choice
failing the stream, and every choice's admission let go however the stream ends (fakes
of ``ServedRequest``: what ``ParallelRequest`` uses of it)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from engine.sampling_params import SamplingParams
from router.errors import RouteError
from router.outputs import OutputChunk, Usage
from router.parallel import ParallelRequest, choice_requests
from router.validation import ValidRequest


class FakeChoice:
    def __init__(self, chunks: list[OutputChunk], log: list[str], name: str,
                 fail: bool = False) -> None:
        self._chunks, self._log, self._name, self._fail = chunks, log, name, fail
        self.ticket = SimpleNamespace(left=0)
        self.ticket.leave = lambda: setattr(self.ticket, "left", self.ticket.left + 1)
        self.trace = None

    async def chunks(self) -> AsyncGenerator[OutputChunk, None]:
        self._log.append(f"{self._name} started")
        try:
            for chunk in self._chunks:
                await asyncio.sleep(0)
                yield chunk
            if self._fail:
                raise RouteError(grpc.StatusCode.UNAVAILABLE, "its decode worker failed")
        finally:
            self.ticket.leave()


def _request(n: int, seed: int | None = 7) -> ValidRequest:
    return ValidRequest("r", (1, 2, 3), SamplingParams(max_tokens=4, seed=seed), n=n)


def test_choices_are_seeded_seed_plus_i() -> None:
    assert [c.sampling.seed for c in choice_requests(_request(3))] == [7, 8, 9]
    assert all(c.n == 1 for c in choice_requests(_request(3)))
    assert [c.sampling.seed for c in choice_requests(_request(2, None))] == [None, None]
    top = ValidRequest("r", (1,), SamplingParams(seed=(1 << 64) - 1), n=2)
    assert [c.sampling.seed for c in choice_requests(top)] == [(1 << 64) - 1, 0]


def _run(parallel: ParallelRequest, stop_after: int | None = None) -> list[OutputChunk]:
    async def main() -> list[OutputChunk]:
        out: list[OutputChunk] = []
        chunks = parallel.chunks()
        try:
            async for chunk in chunks:
                out.append(chunk)
                if stop_after is not None and len(out) >= stop_after:
                    break
        finally:
            await chunks.aclose()
        return out
    return asyncio.run(main())


def test_one_stream_indexed_with_the_usage_once_at_the_end() -> None:
    log: list[str] = []
    choices = [FakeChoice([OutputChunk((i,), "a"), OutputChunk((i, i), "bc", "length",
                                                               Usage(3, 3, 1))], log, f"c{i}")
               for i in range(3)]
    parallel = ParallelRequest(_request(3), choices)  # type: ignore[arg-type]
    out = _run(parallel)
    assert sorted(c.index for c in out) == [0, 0, 1, 1, 2, 2]
    assert [c.usage for c in out[:-1]] == [None] * 5
    assert out[-1].usage == Usage(3, 9, 1)  # the prompt once, every completion token
    assert log[0] == "c0 started"  # the others wait for choice 0's first chunk
    assert all(c.ticket.left >= 1 for c in choices)


def test_a_failed_choice_fails_the_stream_and_leaving_early_lets_all_go() -> None:
    log: list[str] = []
    failing = [FakeChoice([OutputChunk((1,), "a")], log, "c0"),
               FakeChoice([OutputChunk((2,), "b")], log, "c1", fail=True)]
    with pytest.raises(RouteError, match="decode worker failed"):
        _run(ParallelRequest(_request(2), failing))  # type: ignore[arg-type]
    waiting: list[Any] = [FakeChoice([OutputChunk((1,), "a"), OutputChunk((1,), "b")], log, "x0"),
                          FakeChoice([OutputChunk((2,), "c")], log, "x1")]
    parallel = ParallelRequest(_request(2), waiting)  # type: ignore[arg-type]
    assert len(_run(parallel, stop_after=1)) == 1
    assert [c.ticket.left >= 1 for c in waiting] == [True, True]  # however far each got


def test_a_client_that_stops_reading_holds_back_every_choice() -> None:
    # each choice waits for the client to read its chunks (its own bound on buffered
    # chunks then holds, and so does its admission) instead of running to its end into
    # the router's memory
    log: list[str] = []
    made = [0, 0, 0]

    class Counting(FakeChoice):
        def __init__(self, i: int) -> None:
            super().__init__([OutputChunk((i,), "a")] * 5000, log, f"c{i}")
            self.i = i

        async def chunks(self) -> AsyncGenerator[OutputChunk, None]:
            async for chunk in super().chunks():
                made[self.i] += 1
                yield chunk

    choices = [Counting(i) for i in range(3)]
    parallel = ParallelRequest(_request(3), choices)  # type: ignore[arg-type]

    async def main() -> None:
        stream = parallel.chunks()
        await stream.__anext__()  # the client reads one chunk, then stops reading
        for _ in range(200):
            await asyncio.sleep(0)
        assert max(made) <= 10, made
        assert [c.ticket.left for c in choices] == [0, 0, 0]  # still admitted
        await stream.aclose()

    asyncio.run(main())
    assert [c.ticket.left for c in choices] == [1, 1, 1]
