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
