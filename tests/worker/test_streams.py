"""``OutputStream``: items put from the engine-loop thread reach the reader in order;
``ready()`` takes what already arrived without waiting and leaves a failure for ``get``;
``wait_taken`` tells the loop thread when the reader has handed on what it took (the decode
loop waits on it, bounded, before stepping after a first token); and ``merge_outputs``
makes those one output (the decode worker's message to a router that fell behind)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest

from decode_worker.engine_loop import FIRST_CHUNK_WAIT_S, release_first_chunks
from engine.core.engine_core import RequestOutput, merge_outputs
from engine.sampling_params import TokenLogprobs
from worker.commands import WorkerError
from worker.streams import OutputStream


def _out(i: int, finished: bool = False, logprobs: bool = True) -> RequestOutput:
    return RequestOutput("a", [i], f"<{i}>", finished, "length" if finished else None,
                         num_prompt_tokens=5, num_cached_tokens=i, num_resumed_tokens=2,
                         logprobs=[None if i == 0 else TokenLogprobs(i, -1.0, 1, ())]
                         if logprobs else None)


def test_outputs_put_from_a_thread_are_read_in_order_and_ready_takes_the_rest() -> None:
    async def run() -> tuple[RequestOutput, list[RequestOutput], list[RequestOutput]]:
        stream: OutputStream[RequestOutput] = OutputStream(8)
        thread = threading.Thread(target=lambda: [stream.put(_out(i)) for i in range(5)])
        thread.start()
        thread.join()
        first = await stream.get(5.0)
        await asyncio.sleep(0.05)  # the loop thread's call_soon_threadsafe callbacks ran
        rest = stream.ready()
        return first, rest, stream.ready()

    first, rest, after = asyncio.run(run())
    assert first.new_token_ids == [0]
    assert [o.new_token_ids[0] for o in rest] == [1, 2, 3, 4] and after == []


def test_a_failure_stays_for_get_after_the_outputs_before_it() -> None:
    async def run() -> tuple[list[RequestOutput], WorkerError]:
        stream: OutputStream[RequestOutput] = OutputStream(8)
        stream.put(_out(0))
        stream.put(_out(1))
        stream.fail(grpc.StatusCode.UNAVAILABLE, "the engine failed")
        await asyncio.sleep(0.01)
        ready = stream.ready()
        with pytest.raises(WorkerError) as info:
            await stream.get(1.0)
        return ready, info.value

    ready, error = asyncio.run(run())
    assert [o.new_token_ids for o in ready] == [[0], [1]]
    assert error.code == grpc.StatusCode.UNAVAILABLE


def test_get_past_its_timeout_is_deadline_exceeded() -> None:
    async def run() -> WorkerError:
        stream: OutputStream[RequestOutput] = OutputStream(1)
        with pytest.raises(WorkerError) as info:
            await stream.get(0.01)
        return info.value

    assert asyncio.run(run()).code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_wait_taken_returns_once_the_reader_handed_on_what_it_took() -> None:
    """The loop thread's wait ends when the reader, having taken the item and done its work
    with it, asks for the next; an item nobody takes holds it only until its timeout."""
    async def run() -> tuple[bool, list[str], bool]:
        stream: OutputStream[RequestOutput] = OutputStream(4)
        events: list[str] = []

        async def reader() -> None:
            await stream.get(5.0)
            events.append("took")
            await asyncio.sleep(0.05)  # sending it on
            events.append("sent")
            await stream.get(5.0)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.01)  # the reader waits for its first item

        def loop_thread() -> tuple[bool, list[str]]:
            stream.put(_out(0))
            taken = stream.wait_taken(5.0)
            return taken, list(events)  # what the reader had done when the wait ended

        taken, seen = await asyncio.to_thread(loop_thread)
        # a second item the reader takes, then never asks again (its stream ended)
        untaken = await asyncio.to_thread(lambda: (stream.put(_out(1)), stream.wait_taken(0.05))[1])
        await task
        return taken, seen, untaken

    taken, seen, untaken = asyncio.run(run())
    assert taken and seen == ["took", "sent"]
    assert not untaken


def test_the_decode_loop_waits_for_first_chunks_no_longer_than_its_bound() -> None:
    """A first chunk whose reader never asks again (it left) holds the next step back at
    most ``FIRST_CHUNK_WAIT_S``, and is forgotten."""
    async def run() -> tuple[float, int]:
        stream: OutputStream[RequestOutput] = OutputStream(4)
        stream.put(_out(0))
        first_chunks = [(stream, time.monotonic()), (stream, time.monotonic() - 10.0)]
        start = time.monotonic()
        release_first_chunks(first_chunks)
        return time.monotonic() - start, len(first_chunks)

    waited, left = asyncio.run(run())
    assert FIRST_CHUNK_WAIT_S <= 0.01
    assert waited < 1.0 and left == 0  # bounded (generously here), and the list cleared


def test_merge_outputs_keeps_order_and_takes_the_last_counts_and_finish() -> None:
    merged = merge_outputs(_out(0), [_out(1), _out(2, finished=True)])
    assert merged.new_token_ids == [0, 1, 2] and merged.text_delta == "<0><1><2>"
    assert merged.logprobs is not None and merged.logprobs[0] is None
    assert [lp.token_id for lp in merged.logprobs[1:] if lp is not None] == [1, 2]
    assert merged.finished and merged.finish_reason == "length"
    assert merged.num_cached_tokens == 2 and merged.num_resumed_tokens == 2
    plain = merge_outputs(_out(3, logprobs=False), [_out(4, logprobs=False)])
    assert plain.logprobs is None and plain.new_token_ids == [3, 4]
    alone = _out(5)
    assert merge_outputs(alone, []) is alone
    # the first token's output carries the prompt's logprobs: a merge keeps them
    prompt = [TokenLogprobs(9, -1.5, 2)]
    first = dataclasses.replace(_out(6), prompt_logprobs=prompt)
    assert merge_outputs(first, [_out(7)]).prompt_logprobs == prompt
    assert merge_outputs(_out(8), [_out(9)]).prompt_logprobs is None
