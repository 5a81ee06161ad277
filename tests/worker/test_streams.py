"""``OutputStream``: items put from the engine-loop thread reach the reader in order;
``ready()`` takes what already arrived without waiting and leaves a failure for ``get``;
and ``merge_outputs`` makes those one output (the decode worker's message to a router
that fell behind)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import grpc
import pytest

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
