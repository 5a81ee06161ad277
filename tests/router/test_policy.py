"""``router.policy``: the I/O-free prefill decision ``Placement`` and the simulator share."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from router.policy import (
    PrefillChoice,
    choose_prefill,
    decode_side,
    prefill_outwaits_local,
    relative_speeds,
    short_tail,
)
from router.routing import pick_prefill, rendezvous_order

LOADS = {"p0": 0, "p1": 0, "p2": 0}


def choose(mode: str, cached: Mapping[str, int] | None, *,
           queued: Mapping[str, int] | None = None, loads: Mapping[str, int] = LOADS,
           turn: int = 0) -> PrefillChoice:
    """A 100-token prompt of 16-token blocks keyed ``b"k"``."""
    return choose_prefill(mode, key=b"k", loads=loads, queued_tokens=queued or {},
                          num_prompt_tokens=100, block_size=16, cached=cached, turn=turn,
                          epsilon=0.25)


def test_kv_aware_goes_where_the_prefix_is_unless_the_queue_there_costs_more() -> None:
    hit = choose("kv-aware", {"p2": 4})
    assert hit.order[0] == "p2" and hit.reason == "kv_hit" and hit.cached == {"p2": 4}
    # 64 cached tokens saved, but 200 queued there: another worker computes less
    busy = choose("kv-aware", {"p2": 4}, queued={"p2": 200})
    assert busy.order[-1] == "p2" and busy.reason == "kv_cost"
    # nothing cached anywhere, nothing queued: ties go in rendezvous order, as affinity
    assert choose("kv-aware", {}).order == rendezvous_order(b"k", list(LOADS))


def test_without_a_trusted_index_it_is_affinity_and_round_robin_takes_turns() -> None:
    loads = {"p0": 3, "p1": 0, "p2": 0}
    stale = choose("kv-aware", None, loads=loads)
    assert stale.reason == "index_stale" and stale.order == pick_prefill(b"k", loads, 0.25)
    assert choose("affinity", None, loads=loads).reason == "affinity"
    turns = [choose("round-robin", None, turn=t).order[0] for t in range(4)]
    assert turns == ["p0", "p1", "p2", "p0"]


def test_queue_bounds_say_how_much_more_queued_a_worker_may_hold_than_this_router_saw(
        ) -> None:
    # tied and idle, as every router sees a burst's workers: any queue there is one too
    # many (a block's slack); the last worker has no bound
    tied = choose("kv-aware", {})
    assert tied.queue_bounds == dict.fromkeys(tied.order[:-1], 16)
    # a block more for each request this router sees there (they are counted apart)
    loads = {"p0": 2, "p1": 1, "p2": 0}
    seen = choose("kv-aware", {}, loads=loads)
    assert seen.queue_bounds == {w: 16 * (1 + loads[w]) for w in seen.order[:-1]}
    # p2 holds 4 blocks (64 tokens): it costs 36, the next 100; it saw 10 queued there
    hit = choose("kv-aware", {"p2": 4}, queued={"p2": 10})
    assert hit.order[0] == "p2" and hit.queue_bounds["p2"] == 10 + (100 - 46) + 16
    # a worker at a quarter speed: its margin over the next counts in its own tokens
    slow = choose_prefill("kv-aware", key=b"k", loads={"p0": 0, "p1": 0},
                          queued_tokens={"p1": 500}, num_prompt_tokens=100, block_size=16,
                          cached={}, epsilon=0.25, speeds={"p0": 0.25})
    # p0 costs 100 / 0.25 = 400, p1 600: 200 of margin is 50 of p0's tokens
    assert slow.order == ["p0", "p1"] and slow.queue_bounds == {"p0": 50 + 16}
    assert choose("affinity", None).queue_bounds == {}  # kv-aware only


def test_short_tail_needs_a_holder_and_a_short_rest() -> None:
    assert short_tail(32, 100, 16, held_blocks=5)  # 100 - 80 = 20 <= 32
    assert not short_tail(16, 100, 16, held_blocks=5)
    assert not short_tail(32, 100, 16, held_blocks=0)
    assert not short_tail(0, 100, 16, held_blocks=6)  # 0: off


def test_the_decode_worker_prefills_when_every_prefill_worker_has_more_to_compute() -> None:
    # the decode worker's side 100 (decode_side); the least work on a prefill worker (its
    # queue and what it lacks of the prompt) decides
    assert prefill_outwaits_local(64, {"p0": 500, "p1": 101}, 100)
    assert not prefill_outwaits_local(64, {"p0": 500, "p1": 100}, 100)
    assert not prefill_outwaits_local(0, {"p0": 500}, 100)  # conditional disaggregation off
    assert not prefill_outwaits_local(64, {}, 100)  # no prefill worker
    # the local side: what the decode worker lacks, twice, and its backlog
    assert decode_side(20, 30) == 70



def test_only_a_clearly_slower_worker_gets_a_speed_below_one() -> None:
    ids = ["p0", "p1", "p2", "p3"]
    speeds = relative_speeds(ids, {"p0": 400.0, "p1": 300.0, "p2": 100.0})
    # p1 within 1.5x of p0: alike; p2 4x slower: 1.5 x 1/4; p3 reported none
    assert speeds == {"p0": 1.0, "p1": 1.0, "p2": 0.375, "p3": 1.0}
    near = relative_speeds(ids, {"p0": 400.0, "p1": 260.0, "p2": 270.0})  # no step
    assert near["p1"] == pytest.approx(0.975) and near["p2"] == 1.0
    assert relative_speeds(ids, {}) == dict.fromkeys(ids, 1.0)
    slow = choose_prefill("kv-aware", key=b"k", loads=LOADS, queued_tokens={"p0": 40},
                          num_prompt_tokens=100, block_size=16, cached={}, epsilon=0.25,
                          speeds={"p1": 0.25, "p2": 0.25})
    assert slow.order == ["p0", *rendezvous_order(b"k", ["p1", "p2"])]  # 140 < 400
    assert prefill_outwaits_local(64, {"p0": 30}, 100, {"p0": 0.25})  # 120 > 100
    assert not prefill_outwaits_local(64, {"p0": 30}, 100)
