"""``prefill_and_relay``'s cleanup, one layer alone (the Prefill, the Generate stream and
the attempt are stand-ins): however often the request's task is cancelled while the
stream closes, the Prefill task is let go (cancelled and awaited), never orphaned."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from router.lifecycle import relay as relay_module

pytestmark = pytest.mark.timeout(30)


def test_a_cancel_while_the_stream_closes_still_lets_the_prefill_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    prefill_state: dict[str, Any] = {}
    closing = asyncio.Event()

    async def slow_prefill(attempt: Any, placement: Any) -> None:
        prefill_state["task"] = asyncio.current_task()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            prefill_state["cancelled"] = True
            raise

    async def stream(attempt: Any, call: Any) -> AsyncGenerator[str, None]:
        try:
            yield "first"
            await asyncio.sleep(60)
        finally:
            closing.set()
            await asyncio.sleep(0.5)  # a slow close: the second cancel lands here

    monkeypatch.setattr(relay_module, "prefill", slow_prefill)
    monkeypatch.setattr(relay_module, "relay", stream)
    monkeypatch.setattr(relay_module, "start_generate", lambda attempt: None)
    request = SimpleNamespace(sampling=SimpleNamespace(logprobs=None, prompt_logprobs=None))
    attempt = SimpleNamespace(ctx=SimpleNamespace(client_request_id="r", request=request),
                              id="a-1", ahead=None,
                              decode_id="d", is_finished=False)

    async def scenario() -> None:
        chunks = relay_module.prefill_and_relay(attempt, None)  # type: ignore[arg-type]
        assert await anext(chunks) == "first"
        closer = asyncio.ensure_future(chunks.aclose())  # the client left: close it
        await closing.wait()
        closer.cancel()  # and the request's task is cancelled again meanwhile
        with pytest.raises(asyncio.CancelledError):
            await closer
        task = prefill_state["task"]
        assert task.done() and prefill_state.get("cancelled")

    asyncio.run(scenario())


def test_a_move_given_up_frees_the_parked_request_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefill._move`` (the calls stood in for): a move the router gives up on (here the
    draining worker left the registry) sends an Abort of the parked attempt, whose KV
    was held until its offer's end (and the drain waited for it); a move made sends none."""
    from router.lifecycle import prefill as prefill_module
    from router.lifecycle.outcomes import MoveOffer

    aborted: list[tuple[str, str, str]] = []

    class Calls:
        def __init__(self, reply: Any) -> None:
            self.reply = reply

        def start_prefill(self, *args: Any, **kwargs: Any) -> Any:
            if self.reply is None:
                raise KeyError("left the registry")

            async def answered() -> Any:
                return self.reply
            return answered()

        def start_abort(self, worker_id: str, role: str, attempt_id: str) -> Any:
            aborted.append((worker_id, role, attempt_id))
            return None  # nothing to await here

    def attempt(reply: Any) -> Any:
        log = SimpleNamespace(info=lambda *a: None, warning=lambda *a: None)
        counter = SimpleNamespace(inc=lambda: None)
        ctx = SimpleNamespace(
            calls=Calls(reply), timeout=lambda: 5.0, log=log, background=lambda task: None,
            metrics=SimpleNamespace(kv_moves=SimpleNamespace(labels=lambda outcome: counter)),
            trace=SimpleNamespace(mark=lambda name: None, prefill=None),
            pool=SimpleNamespace(watched=lambda worker, call: contextlib.nullcontext()),
            request=SimpleNamespace(prompt_token_ids=[1, 2]))
        ctx.calls.num_resumed = 0
        return SimpleNamespace(ctx=ctx, id="a-2", lease=None, target=object(),
                               prefill_started=lambda worker: None, track=lambda call: None,
                               prefill_released=lambda: None)

    move = MoveOffer("decode-0", "a-1")
    assert asyncio.run(prefill_module._move(attempt(None), move)) is None
    assert aborted == [("decode-0", "decode", "a-1")]
    aborted.clear()
    made = SimpleNamespace(times=None)
    monkeypatch.setattr(prefill_module.WorkerCalls, "prefilled", staticmethod(lambda r: r))
    assert asyncio.run(prefill_module._move(attempt(made), move)) is made
    assert aborted == []


def test_a_queue_refusal_asks_the_next_prefill_worker_and_all_of_them_go_local(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefill.prefill`` (the calls stood in for): a prefill worker that refuses the
    Prefill for its queue (``cluster.prefill_queue``) is passed over for the next one;
    the first is asked below its queue bound (``router.policy.queue_bounds``), and one
    refused over that alone is asked again with the local side of the limit; one dearer
    than the decode worker even idle is not asked; when every one asked refused (or none
    was asked), the attempt ends with ``QueueRefused``."""
    import grpc

    from cluster.prefill_queue import queue_refusal
    from router.lifecycle import prefill as prefill_module
    from router.lifecycle.conditional import DEARER
    from router.lifecycle.outcomes import QueueRefused
    from router.policy import PrefillChoice
    from router.worker_calls import classify

    asked: list[tuple[str, int]] = []
    refused: list[str] = []  # pdserve:router_queue_refusals_total's labels, in turn

    def attempt(holding: dict[str, int], busy: frozenset[str] = frozenset()) -> Any:
        # prompt tokens queued on each worker; busy: at its limit of requests
        def start_prefill(worker: str, *args: Any, max_queued_tokens: int = 0,
                          **kwargs: Any) -> Any:
            asked.append((worker, max_queued_tokens))

            async def answered() -> Any:
                if max_queued_tokens and holding[worker] > max_queued_tokens:
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                        grpc.aio.Metadata(), queue_refusal(holding[worker], max_queued_tokens))
                if worker in busy:  # checked after the queue, as the worker does
                    raise grpc.aio.AioRpcError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                        grpc.aio.Metadata(), "busy: 4 requests held")
                return SimpleNamespace(worker=worker, prefill_tokens_per_s=0.0, times=None,
                                       num_cached_tokens=0, num_prompt_tokens=2)
            return answered()

        counter = SimpleNamespace(inc=lambda: None)
        pool = SimpleNamespace(busy=lambda worker, tokens=0: contextlib.nullcontext(),
                               watched=lambda worker, call: contextlib.nullcontext(),
                               heard_from=lambda worker, rate=0.0: None)
        ctx = SimpleNamespace(
            calls=SimpleNamespace(start_prefill=start_prefill), timeout=lambda: 5.0,
            log=SimpleNamespace(info=lambda *a: None), pending_move=None, pool=pool,
            metrics=SimpleNamespace(routed=SimpleNamespace(labels=lambda *a: counter),
                                    queue_refusals=SimpleNamespace(labels=lambda limit: (
                                        SimpleNamespace(inc=lambda: refused.append(limit))))),
            trace=SimpleNamespace(mark=lambda name: None, prefill=None),
            failure=lambda exc: classify(exc, deadline_passed=False),
            check_deadline=lambda failure: None, block_size=16)
        return SimpleNamespace(ctx=ctx, id="a-3", lease=None, target=object(),
                               decode_id="d-0", prefill_started=lambda worker: None,
                               track=lambda call: None, prefill_released=lambda: None)

    tokens = {"p-0": 2, "p-1": 2}  # what each computes of the prompt
    placement = SimpleNamespace(prefill_order=lambda decode_id: ["p-0", "p-1"],
                                prefill_tokens=tokens.__getitem__,
                                prefill_choice=PrefillChoice(["p-0", "p-1"], "kv_cost",
                                                             queue_bounds={"p-0": 10}))
    monkeypatch.setattr(prefill_module, "queue_limit", lambda placement, d, p: 40)
    monkeypatch.setattr(prefill_module.WorkerCalls, "prefilled", staticmethod(lambda r: r))

    def run(holding: dict[str, int]) -> Any:
        asked.clear()
        refused.clear()
        return asyncio.run(prefill_module.prefill(attempt(holding), placement))  # type: ignore[arg-type]

    def in_order(holding: dict[str, int], busy: frozenset[str]) -> Any:
        asked.clear()
        return asyncio.run(prefill_module._prefill_in_order(  # type: ignore[arg-type]
            attempt(holding, busy), placement, ["p-0", "p-1"]))

    assert run({"p-0": 500, "p-1": 0}).worker == "p-1" and asked == [("p-0", 10), ("p-1", 40)]
    # p-0 holds more than this router saw (10) but less than the local side: asked again
    assert run({"p-0": 30, "p-1": 500}).worker == "p-0"
    assert asked == [("p-0", 10), ("p-1", 40), ("p-0", 40)]
    assert refused == ["bound", "local"]  # each refusal counted by the limit it was over
    with pytest.raises(QueueRefused, match="p-0.*p-1"):
        run({"p-0": 500, "p-1": 500})
    assert asked == [("p-0", 10), ("p-1", 40)]  # both over the local side: not again
    # asked again, p-0 is busy and p-1 was too: that is no queue refusal, it waits
    assert in_order({"p-0": 30, "p-1": 0}, frozenset({"p-0", "p-1"})) is None
    assert asked == [("p-0", 10), ("p-1", 40), ("p-0", 40)]
    # p-0 said it holds 20 (a cost of 22): p-1 may hold no more than 22 - 2 + a block
    assert run({"p-0": 20, "p-1": 39}).worker == "p-0"
    assert asked == [("p-0", 10), ("p-1", 36), ("p-0", 40)]
    # computing 100, p-1 costs more than p-0 holding 20 even idle: not asked
    tokens["p-1"] = 100
    assert run({"p-0": 20, "p-1": 0}).worker == "p-0" and asked == [("p-0", 10), ("p-0", 40)]
    tokens["p-1"] = 2
    # asked again least cost first: p-0 at a quarter speed holding 20 costs 88, p-1 32
    placement.prefill_choice = PrefillChoice(["p-0", "p-1"], "kv_cost",
                                             queue_bounds={"p-0": 10, "p-1": 10},
                                             speeds={"p-0": 0.25})
    assert run({"p-0": 20, "p-1": 30}).worker == "p-1"
    assert asked == [("p-0", 10), ("p-1", 10), ("p-1", 40)]
    # only the first MAX_BOUNDED_ASKS workers asked carry their bound
    monkeypatch.setattr(prefill_module, "MAX_BOUNDED_ASKS", 1)
    placement.prefill_choice = PrefillChoice(["p-0", "p-1"], "kv_cost",
                                             queue_bounds={"p-0": 10, "p-1": 10})
    assert run({"p-0": 30, "p-1": 30}).worker == "p-1"
    assert asked == [("p-0", 10), ("p-1", 40)]
    # a worker dearer than the decode worker even idle (conditional.DEARER) is not asked;
    # with none left, the decode worker prefills it
    monkeypatch.setattr(prefill_module, "queue_limit",
                        lambda placement, d, p: DEARER if p == "p-1" else 40)
    assert run({"p-0": 30, "p-1": 0}).worker == "p-0" and asked == [("p-0", 10), ("p-0", 40)]
    # ... but passing it over is no refusal: the one asked being busy, it waits
    assert in_order({"p-0": 0, "p-1": 0}, frozenset({"p-0"})) is None and asked == [("p-0", 10)]
    monkeypatch.setattr(prefill_module, "queue_limit", lambda placement, d, p: DEARER)
    with pytest.raises(QueueRefused, match="even idle") as raised:
        run({"p-0": 0, "p-1": 0})
    assert raised.value.by_router and asked == []
    # with the decode worker's side off (0), nothing is bounded
    monkeypatch.setattr(prefill_module, "queue_limit", lambda placement, d, p: 0)
    assert run({"p-0": 500, "p-1": 500}).worker == "p-0" and asked == [("p-0", 0)]
