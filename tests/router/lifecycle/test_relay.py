"""``prefill_and_relay``'s cleanup, one layer alone (the Prefill, the Generate stream and
the attempt are stand-ins): however often the request's task is cancelled while the
stream closes, the Prefill task is let go (cancelled and awaited), never orphaned."""

from __future__ import annotations

import asyncio
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
