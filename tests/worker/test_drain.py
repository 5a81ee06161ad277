"""``worker.drain.move_out`` on stand-ins (a loop answering commands, a registry): what a
draining decode worker offers to move, and how long it waits. The real processes:
tests/e2e/test_kv_move.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from worker.commands import MovesPending, OfferMoves
from worker.drain import move_out


class Loop:
    """Decoding requests ``later`` steps from running: each is offered once it runs;
    a move's KV is acknowledged a poll after its offer."""

    role = "decode"

    def __init__(self, running: int, later: list[int]) -> None:
        self.running, self.later, self.polls = running, later, 0
        self.parked = 0
        self.asked: list[str] = []

    async def acall(self, command: object, timeout_s: float | None = None) -> Any:
        self.asked.append(type(command).__name__)
        if isinstance(command, OfferMoves):
            self.polls += 1
            now_running = [n for n in self.later if n <= self.polls]
            self.later = [n for n in self.later if n > self.polls]
            offered, self.running = self.running + len(now_running), 0
            self.parked += offered
            return offered
        assert isinstance(command, MovesPending)
        moved, self.parked = self.parked, 0  # taken and acknowledged
        return moved + len(self.later)


def _heartbeat(*others: str) -> Any:
    records = [SimpleNamespace(worker_id=w, draining=False) for w in ("decode-0", *others)]
    registry = SimpleNamespace(list_workers=lambda role: records)
    return SimpleNamespace(set_draining=lambda: True, registry=registry)


def test_a_request_that_starts_decoding_during_the_drain_is_offered_too() -> None:
    """Its KV arrived for a reservation made before the drain: once it runs it moves (it
    was cut at the end of the grace, and replayed, counted as a failure)."""
    loop = Loop(running=2, later=[3])
    offered = asyncio.run(move_out(loop, _heartbeat("decode-1"), "decode-0", 5.0))  # type: ignore[arg-type]
    assert offered == 3 and loop.later == []


def test_nothing_is_offered_with_nowhere_to_move_to() -> None:
    loop = Loop(running=2, later=[])
    assert asyncio.run(move_out(loop, _heartbeat(), "decode-0", 5.0)) == 0  # type: ignore[arg-type]
    assert loop.asked == []
