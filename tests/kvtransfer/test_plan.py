"""Routes for heterogeneous tensor parallelism: every decode rank gets each of its KV
heads exactly once, from a prefill rank that holds it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.models.layers import kv_head_range
from kvtransfer.plan import Route, check_tp_size, local_heads, plan_routes, routes_from


def test_equal_tp_sizes_pair_ranks() -> None:
    assert plan_routes(4, 2, 2) == [Route(0, 0, 0, 2), Route(1, 1, 2, 4)]


def test_decode_wider_than_prefill() -> None:
    assert plan_routes(4, 1, 2) == [Route(0, 0, 0, 2), Route(0, 1, 2, 4)]


def test_prefill_wider_than_decode() -> None:
    assert plan_routes(4, 2, 1) == [Route(0, 0, 0, 2), Route(1, 0, 2, 4)]


def test_decode_replicates_heads() -> None:
    # one KV head, two decode ranks: both need head 0
    assert plan_routes(1, 1, 2) == [Route(0, 0, 0, 1), Route(0, 1, 0, 1)]


def test_replicated_prefill_spreads_the_sending() -> None:
    # prefill ranks 0 and 1 both hold head 0; decode ranks 0 and 1 each need it
    assert plan_routes(1, 2, 2) == [Route(0, 0, 0, 1), Route(1, 1, 0, 1)]
    assert routes_from(1, 1, 2, 1) == []  # with one decode rank, rank 1 sends nothing


@pytest.mark.parametrize(("heads", "tp"), [(4, 3), (6, 4), (2, 3)])
def test_incompatible_tp_sizes_are_refused(heads: int, tp: int) -> None:
    with pytest.raises(ValueError, match="divide"):
        check_tp_size(heads, tp)


def test_local_heads() -> None:
    assert local_heads(8, 1, 2, 5, 7) == (1, 3)
    with pytest.raises(ValueError, match="holds KV heads"):
        local_heads(8, 0, 2, 3, 5)


def _tp_sizes(heads: int) -> list[int]:
    return [t for t in range(1, 17) if heads % t == 0 or t % heads == 0]


@given(st.sampled_from([1, 2, 4, 8]).flatmap(
    lambda h: st.tuples(st.just(h), st.sampled_from(_tp_sizes(h)), st.sampled_from(_tp_sizes(h)))))
def test_every_decode_rank_gets_exactly_its_heads(case: tuple[int, int, int]) -> None:
    heads, p, r = case
    routes = plan_routes(heads, p, r)
    for j in range(r):
        start, end = kv_head_range(heads, j, r)
        got = Counter(h for rt in routes if rt.receiver_rank == j
                      for h in range(rt.head_start, rt.head_end))
        assert got == Counter(range(start, end))
    for rt in routes:
        start, end = kv_head_range(heads, rt.sender_rank, p)
        assert start <= rt.head_start < rt.head_end <= end
    # replicas share the sending: as many prefill ranks send as there are distinct
    # (head, replica) pairs that some decode rank can use
    senders = {rt.sender_rank for rt in routes}
    assert len(senders) == (p if p <= heads else heads * min(p // heads, max(1, r // heads)))
