"""``Handoff``'s failure accounting on stand-ins (no worker): what the client is told
when attempts run out. The real processes: tests/e2e (migration, retries)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

from router.errors import RouteError
from router.lifecycle.handoff import Handoff
from router.lifecycle.outcomes import Migrate, QueueRefused, Retry
from router.outputs import OutputChunk


class Attempt:
    def __init__(self, n: int) -> None:
        self.id, self.decode_id = f"a#{n}", f"decode-{n}"

    def end(self) -> None:
        pass

    def decode_holds_nothing(self) -> None:
        pass

    async def abort_decode_now(self) -> None:
        pass


class Scripted(Handoff):
    """Attempt 0 streams one token and loses its decode worker; every later one fails
    before its first token."""

    def __init__(self) -> None:
        config = SimpleNamespace(max_attempts=3, migration_limit=2)
        ctx = SimpleNamespace(config=config, metrics=MagicMock(), excluded=set(),
                              log=logging.getLogger("test"), clock=lambda: 0.0,
                              pending_move=None, calls=MagicMock())
        super().__init__(ctx, MagicMock())  # type: ignore[arg-type]
        self.placed = 0

    async def _place_after(self, failures: list[str]) -> Attempt:  # type: ignore[override]
        self.placed += 1
        return Attempt(self.placed - 1)

    async def _run(self, attempt: Attempt) -> AsyncGenerator[OutputChunk, None]:  # type: ignore[override]
        if attempt.id == "a#0":
            yield OutputChunk((7,), "x")
            raise Migrate("its decode worker died", "died", 1, "decode-0")
        raise Retry(f"{attempt.decode_id} refused the Reserve", "reserve")
        yield  # pragma: no cover - a generator


def test_attempts_spent_after_a_migration_name_the_tokens_streamed() -> None:
    handoff = Scripted()

    async def drain() -> list[OutputChunk]:
        return [chunk async for chunk in handoff._attempts()]

    with pytest.raises(RouteError) as info:
        asyncio.run(drain())
    message = info.value.message
    assert "before the first token" not in message  # the client has a token already
    assert "after 1 streamed tokens" in message and "failed 3 times" in message
    assert "its decode worker died" in message and handoff.placed == 4


class RefusedThenLocal(Scripted):
    """Attempt 0's prefill worker refuses it for its queue; attempt 1 streams its token."""

    def __init__(self) -> None:
        super().__init__()
        self.ctx.local_reason = None
        self.aborted: list[str] = []
        self.reasons: list[str | None] = []

    async def _place_after(self, failures: list[str]) -> Attempt:  # type: ignore[override]
        self.reasons.append(self.ctx.local_reason)
        attempt = await super()._place_after(failures)
        outer = self

        async def abort_decode_now() -> None:
            outer.aborted.append(attempt.id)

        attempt.abort_decode_now = abort_decode_now  # type: ignore[method-assign]
        return attempt

    async def _run(self, attempt: Attempt) -> AsyncGenerator[OutputChunk, None]:  # type: ignore[override]
        if attempt.id == "a#0":
            raise QueueRefused("prefill worker p-0: queue: longer than the caller's limit")
        yield OutputChunk((7,), "x", finish_reason="length")


def test_a_queue_refusal_places_a_local_attempt_without_spending_one() -> None:
    handoff = RefusedThenLocal()

    async def drain() -> list[OutputChunk]:
        return [chunk async for chunk in handoff._attempts()]

    chunks = asyncio.run(drain())
    assert [c.token_ids for c in chunks] == [(7,)]
    # attempt 0's reservation is freed; attempt 1 is told why it prefills locally
    assert handoff.aborted == ["a#0"] and handoff.placed == 2
    assert handoff.reasons == [None, "local_queue_refused"]
    handoff.ctx.metrics.retries.labels.assert_not_called()  # not a failure
