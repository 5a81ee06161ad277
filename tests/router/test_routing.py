"""router.routing: rendezvous hashing, bounded-load prefill choice, affinity keys and
decode ranking. Pure functions, no processes."""

from __future__ import annotations

import math
import random
import struct
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.kvcache.block_hash import compute_block_hashes
from router.config import AFFINITY_BLOCKS, HandoffConfig
from router.routing import (
    DecodeCandidate,
    affinity_key,
    load_bound,
    pick_prefill,
    rank_by_cost,
    rank_decode,
    rendezvous_order,
    round_robin,
    uncached_tokens,
)

WORKERS = ["prefill-0", "prefill-1", "prefill-2", "prefill-3"]
BLOCK_SIZE = 4

worker_ids = st.text("abcdefgh0123456789-", min_size=1, max_size=8)
keys = st.binary(min_size=0, max_size=24)


def _keys(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(count)]


def _bound(loads: dict[str, int], epsilon: float) -> int:
    """The documented bound, computed independently with exact arithmetic."""
    total = sum(loads.values())
    return math.ceil((1 + Fraction(str(epsilon))) * (total + 1) / len(loads))


# --- rendezvous order ---------------------------------------------------------------


@given(key=keys, workers=st.lists(worker_ids, min_size=1, max_size=8, unique=True),
       shuffle_seed=st.integers(0, 2**32))
def test_rendezvous_order_is_a_deterministic_permutation_independent_of_input_order(
        key: bytes, workers: list[str], shuffle_seed: int) -> None:
    order = rendezvous_order(key, workers)
    shuffled = list(workers)
    random.Random(shuffle_seed).shuffle(shuffled)
    assert sorted(order) == sorted(workers)
    assert rendezvous_order(key, shuffled) == order
    assert rendezvous_order(key, tuple(reversed(workers))) == order


@given(keys_=st.lists(keys, min_size=1, max_size=30),
       workers=st.lists(worker_ids, min_size=2, max_size=8, unique=True),
       data=st.data())
def test_removing_a_worker_moves_only_its_own_keys(
        keys_: list[bytes], workers: list[str], data: st.DataObject) -> None:
    removed = data.draw(st.sampled_from(workers))
    remaining = [w for w in workers if w != removed]
    for key in keys_:
        before = rendezvous_order(key, workers)
        after = rendezvous_order(key, remaining)
        if before[0] != removed:
            assert after[0] == before[0]
        # Stronger: the relative order of the survivors never changes.
        assert after == [w for w in before if w != removed]


@given(keys_=st.lists(keys, min_size=1, max_size=30),
       workers=st.lists(worker_ids, min_size=1, max_size=6, unique=True),
       added=worker_ids)
def test_adding_a_worker_only_takes_keys_for_itself(
        keys_: list[bytes], workers: list[str], added: str) -> None:
    if added in workers:
        return
    for key in keys_:
        top_before = rendezvous_order(key, workers)[0]
        top_after = rendezvous_order(key, [*workers, added])[0]
        assert top_after in (top_before, added)


def test_keys_spread_roughly_evenly_over_workers() -> None:
    counts = Counter(rendezvous_order(key, WORKERS)[0] for key in _keys(1000))
    assert set(counts) == set(WORKERS)
    for worker in WORKERS:
        assert 150 <= counts[worker] <= 350, counts


def test_order_depends_on_the_key() -> None:
    orders = {tuple(rendezvous_order(key, WORKERS)) for key in _keys(200, seed=1)}
    assert len(orders) > 12  # 24 permutations exist; a key-blind order would give 1


# --- pick_prefill ---------------------------------------------------------------------


def test_pick_prefill_without_workers_is_empty() -> None:
    assert pick_prefill(b"key", {}) == []


def test_pick_prefill_with_equal_loads_is_the_rendezvous_order() -> None:
    for load in (0, 5):
        for key in _keys(50, seed=2):
            loads = dict.fromkeys(WORKERS, load)
            assert pick_prefill(key, loads) == rendezvous_order(key, WORKERS)


def test_overloaded_top_overflows_to_the_next_worker_in_rendezvous_order() -> None:
    for key in _keys(50, seed=3):
        order = rendezvous_order(key, WORKERS)
        # total 10, n 4: bound ceil(1.25 * 11 / 4) = 4; the top would reach 11.
        loads = {order[0]: 10, order[1]: 0, order[2]: 0, order[3]: 0}
        assert pick_prefill(key, loads, epsilon=0.25) == [*order[1:], order[0]]


def test_overloaded_workers_are_listed_last_in_rendezvous_order() -> None:
    for key in _keys(50, seed=4):
        order = rendezvous_order(key, WORKERS)
        # total 16, n 4: bound ceil(1.25 * 17 / 4) = 6; 8 + 1 is over, 0 + 1 is within.
        loads = {order[0]: 8, order[1]: 0, order[2]: 8, order[3]: 0}
        assert pick_prefill(key, loads, epsilon=0.25) == [order[1], order[3], order[0], order[2]]


def test_bound_at_its_boundaries() -> None:
    key = b"boundary"
    cases = [
        # (loads, epsilon, expected bound, expected over-bound workers)
        ({"a": 4, "b": 4, "c": 4, "d": 3}, 0.25, 5, set()),  # load + 1 == bound: within
        ({"a": 5, "b": 4, "c": 3, "d": 3}, 0.25, 5, {"a"}),  # load + 1 == bound + 1: over
        ({"a": 3, "b": 3, "c": 3, "d": 3, "e": 3}, 0.25, 4, set()),  # 1.25 * 16 / 5 = 4.0
        ({"a": 4, "b": 3, "c": 3, "d": 3, "e": 2}, 0.25, 4, {"a"}),
        ({"a": 4, "b": 4, "c": 4, "d": 2, "e": 2}, 0.25, 5, set()),  # 4.25 rounds up
        ({"a": 1, "b": 0}, 0.0, 1, {"a"}),  # epsilon 0: bound is the mean after placement
        ({"a": 0}, 0.25, 2, set()),  # one worker is always within
        ({"a": 11, "b": 10, "c": 10, "d": 10, "e": 8}, 0.1, 11, {"a"}),  # 1.1 * 50 / 5 = 11
    ]
    for loads, epsilon, bound, over in cases:
        assert _bound(loads, epsilon) == bound, loads
        picked = pick_prefill(key, loads, epsilon)
        within = [w for w in picked if w not in over]
        assert picked == within + [w for w in picked if w in over], (loads, picked)
        order = rendezvous_order(key, list(loads))
        assert within == [w for w in order if w not in over], (loads, picked)


def test_float_epsilon_does_not_widen_the_bound() -> None:
    # In floats (1 + 0.1) * 50 / 5 == 11.000000000000002, which ceil()s to 12.
    loads = {"a": 11, "b": 10, "c": 10, "d": 10, "e": 8}
    for key in _keys(20, seed=5):
        assert pick_prefill(key, loads, epsilon=0.1)[-1] == "a"


@given(total=st.integers(0, 10_000), num_workers=st.integers(1, 1024),
       epsilon=st.sampled_from([0.0, 0.05, 0.1, 1 / 3, 0.25, 0.5, 1.0, 2.5]))
def test_load_bound_is_the_exact_ceiling(total: int, num_workers: int, epsilon: float) -> None:
    loads = {str(i): 0 for i in range(num_workers)} | {"0": total}
    assert load_bound(epsilon, total, num_workers) == _bound(loads, epsilon)


@given(loads=st.dictionaries(worker_ids, st.integers(0, 1000), min_size=1, max_size=8),
       epsilon=st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]),
       key=keys)
def test_pick_prefill_first_choice_is_always_within_the_bound(
        loads: dict[str, int], epsilon: float, key: bytes) -> None:
    picked = pick_prefill(key, loads, epsilon)
    bound = _bound(loads, epsilon)
    assert sorted(picked) == sorted(loads)
    assert loads[picked[0]] + 1 <= bound
    flags = [loads[w] + 1 <= bound for w in picked]
    assert flags == sorted(flags, reverse=True)  # every within-bound worker first
    order = rendezvous_order(key, list(loads))
    assert [w for w in picked if loads[w] + 1 <= bound] == [
        w for w in order if loads[w] + 1 <= bound]


# --- affinity_key ---------------------------------------------------------------------


def _key_of(tokens: list[int]) -> bytes:
    return affinity_key(compute_block_hashes(tokens, BLOCK_SIZE), tokens)


def test_prompts_sharing_the_leading_blocks_share_the_key() -> None:
    prefix = list(range(100, 100 + AFFINITY_BLOCKS * BLOCK_SIZE))
    a = _key_of([*prefix, 1, 2, 3, 4, 5])
    b = _key_of([*prefix, 9, 9, 9, 9, 9, 9, 9, 9, 9])
    assert a == b == _key_of(prefix)
    assert a == compute_block_hashes(prefix, BLOCK_SIZE)[AFFINITY_BLOCKS - 1]


def test_prompts_differing_in_the_first_block_differ() -> None:
    tokens = list(range(100, 100 + (AFFINITY_BLOCKS + 2) * BLOCK_SIZE))
    other = list(tokens)
    other[1] += 1
    assert _key_of(tokens) != _key_of(other)
    # ...and a difference inside the last affinity block still counts.
    other = list(tokens)
    other[AFFINITY_BLOCKS * BLOCK_SIZE - 1] += 1
    assert _key_of(tokens) != _key_of(other)


def test_shorter_prompts_use_their_last_full_block() -> None:
    tokens = list(range(100, 100 + 2 * BLOCK_SIZE + 1))  # 2 full blocks + 1 token
    hashes = compute_block_hashes(tokens, BLOCK_SIZE)
    assert len(hashes) == 2
    assert affinity_key(hashes, tokens) == hashes[1]
    assert _key_of(tokens) == _key_of(tokens[:-1])  # the partial block plays no part
    assert affinity_key(hashes, tokens, num_blocks=1) == hashes[0]


def test_prompts_without_a_full_block_are_keyed_by_their_tokens() -> None:
    tokens = [5, 6, 7]
    key = affinity_key([], tokens)
    assert key == struct.pack("<3q", 5, 6, 7)
    assert affinity_key([], [5, 6, 8]) != key
    assert affinity_key([], [5, 6]) != key


# --- rank_decode ----------------------------------------------------------------------


def test_rank_decode_prefers_least_inflight_then_most_free_then_id() -> None:
    candidates = [
        DecodeCandidate("d-c", inflight=1, free_kv_blocks=100, total_kv_blocks=100),
        DecodeCandidate("d-b", inflight=0, free_kv_blocks=10, total_kv_blocks=100),
        DecodeCandidate("d-a", inflight=0, free_kv_blocks=50, total_kv_blocks=100),
        DecodeCandidate("d-e", inflight=0, free_kv_blocks=50, total_kv_blocks=100),
        DecodeCandidate("d-d", inflight=2, free_kv_blocks=99, total_kv_blocks=100),
    ]
    assert rank_decode(candidates, num_blocks=4) == ["d-a", "d-e", "d-b", "d-c", "d-d"]
    assert rank_decode(list(reversed(candidates)), num_blocks=4) == [
        "d-a", "d-e", "d-b", "d-c", "d-d"]


def test_rank_decode_excludes_pools_too_small_for_the_request() -> None:
    candidates = [
        DecodeCandidate("small", inflight=0, free_kv_blocks=8, total_kv_blocks=8),
        DecodeCandidate("exact", inflight=3, free_kv_blocks=0, total_kv_blocks=9),
        DecodeCandidate("big", inflight=5, free_kv_blocks=64, total_kv_blocks=64),
    ]
    assert rank_decode(candidates, num_blocks=9) == ["exact", "big"]
    assert rank_decode(candidates, num_blocks=8) == ["small", "exact", "big"]
    assert rank_decode(candidates, num_blocks=65) == []
    assert rank_decode([], num_blocks=1) == []


def test_round_robin_takes_workers_in_turn_whatever_the_prompt() -> None:
    workers = ["p-b", "p-a", "p-c"]
    firsts = [round_robin(workers, turn)[0] for turn in range(6)]
    assert firsts == ["p-a", "p-b", "p-c", "p-a", "p-b", "p-c"]
    assert round_robin(workers, 1) == ["p-b", "p-c", "p-a"]  # the rest follow as fallbacks
    assert round_robin([], 3) == []
    with pytest.raises(ValueError, match="prefill_routing"):
        HandoffConfig(prefill_routing="random")


# --- kv-aware ---------------------------------------------------------------------


def test_uncached_tokens_are_what_the_engine_computes() -> None:
    """The engine's cache serves at most the full blocks before the last token's
    (``Scheduler.cached_prefix``): a prompt of whole blocks, all cached, computes its last
    block again."""
    assert uncached_tokens(100, 16, 0) == 100
    assert uncached_tokens(100, 16, 2) == 68
    assert uncached_tokens(33, 16, 2) == 1  # the last token alone, in a block of its own
    assert uncached_tokens(32, 16, 2) == 16  # the last block, not its last token alone
    assert uncached_tokens(32, 16, 1) == 16
    assert uncached_tokens(100, 16, 50) == 4  # more held than the prompt has: 6 blocks


@given(key=keys, workers=st.lists(worker_ids, min_size=1, max_size=8, unique=True),
       costs=st.lists(st.integers(0, 5), min_size=8, max_size=8))
def test_rank_by_cost_sorts_by_cost_with_ties_in_rendezvous_order(
        key: bytes, workers: list[str], costs: list[int]) -> None:
    cost = dict(zip(workers, costs, strict=False))
    order = rank_by_cost(key, cost)
    assert sorted(order) == sorted(workers)
    assert [cost[w] for w in order] == sorted(cost.values())
    rendezvous = rendezvous_order(key, workers)
    for low in set(cost.values()):
        tied = [w for w in order if cost[w] == low]
        assert tied == [w for w in rendezvous if cost[w] == low]


def test_with_equal_costs_kv_aware_routes_as_affinity() -> None:
    key = _keys(1)[0]
    assert rank_by_cost(key, dict.fromkeys(WORKERS, 7)) == pick_prefill(key, dict.fromkeys(
        WORKERS, 0))


def test_rank_decode_prefers_the_longest_cached_prefix_within_the_load_bound() -> None:
    candidates = [
        DecodeCandidate("idle", inflight=0, free_kv_blocks=90, total_kv_blocks=100),
        DecodeCandidate("holder", inflight=1, free_kv_blocks=50, total_kv_blocks=100,
                        cached_blocks=6),
        DecodeCandidate("partial", inflight=1, free_kv_blocks=50, total_kv_blocks=100,
                        cached_blocks=2),
    ]
    assert rank_decode(candidates, num_blocks=4) == ["holder", "partial", "idle"]
    # past the bound (ceil(1.25 * (0 + 4 + 1 + 1) / 3) = 3 requests), the holder goes last
    crowded = [candidates[0], DecodeCandidate("holder", inflight=4, free_kv_blocks=50,
                                              total_kv_blocks=100, cached_blocks=6),
               candidates[2]]
    assert rank_decode(crowded, num_blocks=4) == ["partial", "idle", "holder"]
