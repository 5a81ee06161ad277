"""``InFlightKV``: the prompts a router is bringing to a decode worker, and which of them
covers a new prompt but a short tail (``router.lifecycle.coalesce`` waits for it). The
real processes: tests/e2e/test_kv_routing.py."""

from __future__ import annotations

import asyncio

from router.inflight_kv import InFlightKV

BLOCK = 16
SYSTEM = [b"s0", b"s1", b"s2", b"s3"]  # a shared 64-token system prompt's blocks


def test_the_prompt_in_flight_covering_the_most_blocks_is_waited_for() -> None:
    flight = InFlightKV()
    flight.sent("chat-0", [*SYSTEM, b"a0"])
    flight.sent("chat-1", SYSTEM[:2])
    # a first turn of another chat: the system prompt and 20 tokens of its own (1 block
    # and 4 tokens): chat-0 covers its 4 system blocks, so it lacks 20 tokens
    entry = flight.covering([*SYSTEM, b"b0"], 4 * BLOCK + 20, BLOCK, limit=64)
    assert entry is not None and entry.block_hashes == (*SYSTEM, b"a0")
    # over the limit once covered: not worth a wait
    assert flight.covering([*SYSTEM, b"b0"], 4 * BLOCK + 20, BLOCK, limit=16) is None
    # another first block, no block at all, or the rule off: nothing to wait for
    assert flight.covering([b"x", *SYSTEM], 80, BLOCK, limit=64) is None
    assert flight.covering([], 10, BLOCK, limit=64) is None
    assert flight.covering([*SYSTEM, b"b0"], 84, BLOCK, limit=0) is None
    flight.sent("chat-0", [b"other"])  # a request is noted once
    assert len(flight) == 2


def test_a_prompt_that_lands_or_ends_frees_its_waiters_and_is_forgotten() -> None:
    flight = InFlightKV()
    flight.sent("chat-0", [*SYSTEM, b"a0"])
    flight.sent("chat-1", [*SYSTEM, b"a1"])
    entry = flight.covering([*SYSTEM, b"a0"], 5 * BLOCK + 3, BLOCK, limit=64)
    assert entry is not None

    async def waiter() -> bool:
        await asyncio.wait_for(entry.arrived.wait(), 1.0)
        return True

    async def scenario() -> bool:
        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        assert not task.done()
        flight.ended("chat-0")
        flight.ended("chat-0")  # twice (its first token, then its end): no harm
        return await task

    assert asyncio.run(scenario())
    assert len(flight) == 1
    # chat-1 still covers the system prompt
    assert flight.covering([*SYSTEM], 4 * BLOCK + 1, BLOCK, limit=64) is not None
    flight.ended("chat-1")
    assert len(flight) == 0 and flight.covering([*SYSTEM], 65, BLOCK, limit=64) is None
    flight.ended("never-sent")  # a request that never was in flight
