"""``ParallelRequest``: the n choices of one request (``n`` > 1) as one stream.

Each choice is a request of its own through the whole lifecycle — admitted, placed,
prefilled, decoded, migrated, cancelled — with the same prompt and sampling but for its
seed: choice i samples with ``seed + i`` (mod 2**64; unseeded choices draw freely), so
choice 0 is the n = 1 answer and every seeded choice is reproducible. Their prompts are
the same: the other choices start once choice 0's first token is out — its prompt's KV
is then in the prefix cache of choice 0's decode worker, where the others prefill locally
(``router.lifecycle.context.SharedDecode``): it computes only their last prompt token's
block, so the prompt is computed on a prefill worker and its KV moved once. Their
chunks are interleaved as they come, each tagged with its ``index``, and
the usage of the whole request (the prompt once, every choice's completion tokens) goes
on the stream's very last chunk. A failed choice fails the request (the others are
cancelled); leaving the stream cancels every choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from router.outputs import OutputChunk, Usage
from router.served import ServedRequest
from router.trace import Trace
from router.validation import ValidRequest

_UINT64 = (1 << 64) - 1


def choice_requests(request: ValidRequest) -> list[ValidRequest]:
    """The ``request.n`` requests of ``request``'s choices (seeds as the module says)."""
    seed = request.sampling.seed

    def choice(i: int) -> ValidRequest:
        sampling = request.sampling if seed is None else dataclasses.replace(
            request.sampling, seed=(seed + i) & _UINT64)
        return dataclasses.replace(request, sampling=sampling, n=1)

    return [choice(i) for i in range(request.n)]


class ParallelRequest:
    """The choices of one request, served as one stream (see the module docstring);
    ``chunks()`` is iterated once."""

    def __init__(self, request: ValidRequest, choices: Sequence[ServedRequest]) -> None:
        self.request = request
        self.choices = list(choices)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def trace(self) -> Trace:
        return self.choices[0].trace  # the first choice's (traces are per request)

    async def chunks(self) -> AsyncGenerator[OutputChunk, None]:
        # bounded: a choice waits for the client to read, so each choice's own bound on
        # buffered chunks (and "client too slow") holds, and its admission lasts until
        # the client read its end
        queue: asyncio.Queue[tuple[int, OutputChunk | BaseException | None]] = \
            asyncio.Queue(maxsize=len(self.choices))

        first_out = asyncio.Event()  # choice 0's prompt is computed (and cached)
        started: set[int] = set()  # the choices whose chunks() runs (it leaves admission)

        async def pump(index: int, served: ServedRequest) -> None:
            try:
                if index:
                    await first_out.wait()
                started.add(index)
                async with aclosing(served.chunks()) as chunks:
                    async for chunk in chunks:
                        if not index:
                            first_out.set()
                        await queue.put((index, chunk))
                await queue.put((index, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the reader
                await queue.put((index, exc))
            finally:
                if not index:
                    first_out.set()

        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(self.choices)]
        usages: dict[int, Usage] = {}
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.usage is not None:
                    usages[index] = item.usage
                    item = dataclasses.replace(item, usage=self._total(usages))
                yield dataclasses.replace(item, index=index)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for index, served in enumerate(self.choices):
                if index not in started:  # never served: its admission is let go here
                    served.ticket.leave()

    def _total(self, usages: dict[int, Usage]) -> Usage | None:
        """The request's usage once every choice has reported its own (else None)."""
        if len(usages) < len(self.choices):
            return None
        first = usages[0]
        return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages.values()),
                     first.cached_tokens)
