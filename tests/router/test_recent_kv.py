"""``RecentKV`` on a stand-in clock: what a router saw land on a decode worker keeps the
Prefill from going ahead there for a while; the gate and ``ahead_target`` read it. The
real processes: tests/e2e/test_prefill_ahead.py."""

from __future__ import annotations

from types import SimpleNamespace

from router.lifecycle.ahead import REFUSAL_MEMORY_S, AheadGate, ahead_target
from router.recent_kv import RecentKV


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_prompt_starting_with_a_landed_block_may_be_held_there_for_the_window() -> None:
    clock = Clock()
    recent = RecentKV(clock, window_s=2.0)
    recent.landed("d-0", [b"a", b"b"])
    assert recent.may_hold("d-0", [b"a"])  # the same first block: a prefix of it
    assert recent.may_hold("d-0", [b"a", b"x", b"y"])
    assert not recent.may_hold("d-1", [b"a"])  # another worker
    assert not recent.may_hold("d-0", [b"b"])  # another first block
    assert not recent.may_hold("d-0", [])  # no full block: nothing to reuse
    recent.landed("d-0", [])  # nor to note
    assert len(recent) == 1
    clock.now += 1.5
    recent.landed("d-0", [b"a"])  # landed again (its finish): the window starts again
    clock.now += 1.5
    assert recent.may_hold("d-0", [b"a"])
    clock.now += 0.5
    assert not recent.may_hold("d-0", [b"a"])


def test_the_blocks_held_are_the_longest_run_shared_with_a_prompt_that_landed() -> None:
    clock = Clock()
    recent = RecentKV(clock, window_s=2.0)
    recent.landed("d-0", [b"s", b"t", b"a0", b"a1"])  # two chats' turns, one system prompt
    recent.landed("d-0", [b"s", b"t", b"b0"])
    assert recent.held_blocks("d-0", [b"s", b"t", b"a0", b"a1", b"a2"]) == 4
    assert recent.held_blocks("d-0", [b"s", b"t", b"b0", b"b1"]) == 3
    assert recent.held_blocks("d-0", [b"s", b"t", b"c0"]) == 2  # the system prompt
    assert recent.held_blocks("d-1", [b"s", b"t"]) == 0  # another worker
    assert recent.held_blocks("d-0", [b"x", b"t"]) == 0 and recent.held_blocks("d-0", []) == 0
    clock.now += 2.0
    assert recent.held_blocks("d-0", [b"s", b"t"]) == 0  # past the window


def test_notes_past_the_window_or_the_cap_are_dropped_oldest_first() -> None:
    clock = Clock()
    recent = RecentKV(clock, window_s=2.0, max_notes=3)
    for i in range(3):
        recent.landed("d-0", [bytes([i])])
    recent.landed("d-0", [b"\x00"])  # refreshed: now the newest
    recent.landed("d-0", [b"\x09"])  # past the cap: the oldest (1) goes
    assert [recent.may_hold("d-0", [bytes([i])]) for i in (0, 1, 2, 9)] == [
        True, False, True, True]
    clock.now += 2.0
    recent.landed("d-1", [b"z"])  # every older note expired: dropped on the way
    assert len(recent) == 1


def _attempt(decode_id: str = "d-0", free_blocks: int = 64,
             max_tokens: int = 16) -> SimpleNamespace:
    record = SimpleNamespace(worker_id=decode_id, kv_address="127.0.0.1:1",
                             tensor_parallel_size=1, free_kv_blocks=free_blocks)
    prompt = list(range(40))  # 3 blocks of 16
    request = SimpleNamespace(prompt_token_ids=prompt,
                              num_blocks=lambda size: -(-(len(prompt) + max_tokens) // size))
    ctx = SimpleNamespace(pending_move=None, block_size=16, request=request,
                          pool=SimpleNamespace(routable=lambda role: [record]))
    return SimpleNamespace(ctx=ctx, decode_id=decode_id, transfer_id=7)


def test_the_prefill_goes_ahead_where_the_prompt_fits_whatever_max_tokens() -> None:
    # a Reserve takes the prompt's blocks: a chat request without max_tokens (the whole
    # context) still sends its Prefill ahead where its prompt fits, not where it does not
    gate = AheadGate(Clock())
    assert ahead_target(_attempt(free_blocks=3, max_tokens=8000), gate, 0) is not None  # type: ignore[arg-type]
    assert ahead_target(_attempt(free_blocks=2), gate, 0) is None  # type: ignore[arg-type]


def test_the_prefill_waits_for_the_reply_where_the_router_saw_the_prompt_land() -> None:
    clock = Clock()
    gate = AheadGate(clock)
    hashes = [b"a", b"b", b"c"]
    target = ahead_target(_attempt(), gate, 0, hashes)  # type: ignore[arg-type]
    assert target is not None and target.num_cached_blocks == 0
    gate.recent.landed("d-0", hashes[:2])  # an earlier turn's KV landed there
    assert ahead_target(_attempt(), gate, 0, hashes) is None  # type: ignore[arg-type]
    assert ahead_target(_attempt(), gate, 0, [b"q"]) is not None  # type: ignore[arg-type]
    clock.now += 5.0  # the index has long listed it (held_blocks would say so)
    assert ahead_target(_attempt(), gate, 0, hashes) is not None  # type: ignore[arg-type]


def test_a_refusal_holds_prefills_back_until_an_acceptance_or_its_memory_ends() -> None:
    clock = Clock()
    gate = AheadGate(clock)
    gate.reserve_answered("d-0", reserved=False, for_want_of_room=True)
    gate.reserve_answered("d-1", reserved=False, for_want_of_room=False)  # not for room
    assert not gate.allows("d-0") and gate.allows("d-1")
    gate.reserve_answered("d-0", reserved=True, for_want_of_room=False)
    assert gate.allows("d-0") and gate.num_refusals == 0
    for i in range(50):  # workers that refused, then left the cluster
        gate.reserve_answered(f"gone-{i}", reserved=False, for_want_of_room=True)
    assert not gate.allows("gone-0")
    clock.now += REFUSAL_MEMORY_S + 1
    assert gate.allows("gone-0")  # still full, it refuses the next one itself
    gate.reserve_answered("d-2", reserved=False, for_want_of_room=True)
    assert gate.num_refusals == 1  # the others forgotten
