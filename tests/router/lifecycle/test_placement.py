"""Placement's kv-aware decisions on a stand-in pool: the KV index's word, the cluster's
load, the fallback to affinity, conditional disaggregation. One layer (the lifecycle's
choice of workers); the real processes are tests/e2e/test_kv_routing.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from cluster.kv_events import EventBatch
from engine.kvcache.block_hash import LOSSY_WIRE_SALT, compute_block_hashes
from engine.kvcache.events import STORED
from router.config import HandoffConfig
from router.kv_index import KVIndex
from router.lifecycle.conditional import DEARER, queue_limit
from router.lifecycle.placement import Placement
from router.metrics import RouterMetrics
from router.policy import relative_speeds
from router.routing import affinity_key, rendezvous_order

BLOCK = 16


@dataclass
class Pool:
    """What Placement reads of a ``WorkerPool``."""

    tokens: dict[str, int] = field(default_factory=dict)  # every router's, per worker
    decode: tuple[str, ...] = ("d-0",)
    rates: dict[str, float] = field(default_factory=dict)  # as the workers reported them

    def routable(self, role: str) -> list[Any]:
        names = ["p-0", "p-1"] if role == "prefill" else list(self.decode)
        return [SimpleNamespace(worker_id=n, free_kv_blocks=64, total_kv_blocks=64)
                for n in names]

    def cluster_inflight(self, worker_id: str) -> int:
        return 1 if self.tokens.get(worker_id) else 0

    def cluster_tokens(self, worker_id: str) -> int:
        return self.tokens.get(worker_id, 0)

    def prefill_speeds(self, worker_ids: Iterable[str]) -> dict[str, float]:
        return relative_speeds(list(worker_ids), self.rates)


def _placement(prompt: list[int], index: KVIndex | None, pool: Pool, salt: str = "",
               **config: Any) -> tuple[Placement, RouterMetrics]:
    metrics = RouterMetrics()
    request = SimpleNamespace(prompt_token_ids=prompt,
                              num_blocks=lambda size: -(-len(prompt) // size))
    ctx = SimpleNamespace(pool=pool, request=request,
                          config=HandoffConfig(**config), kv_index=index, metrics=metrics,
                          excluded=set(), block_size=BLOCK, hash_seed=0, shared_decode=None,
                          choice=0, calls=SimpleNamespace(num_resumed=0),
                          received_kv_salt=salt, pending_move=None,
                          local_reason=None)
    return Placement(ctx, None, itertools.count()), metrics  # type: ignore[arg-type]


def _index(holdings: dict[str, list[bytes]]) -> KVIndex:
    index = KVIndex()
    index.watch([*holdings, "p-0", "p-1", "d-0", "d-1"])
    for worker, hashes in holdings.items():
        index.apply(EventBatch(worker, 1, 1, tuple((STORED, h) for h in hashes)))
    index.heard()
    return index


def _prompt_by_affinity(worker: str) -> list[int]:
    for salt in range(100):
        prompt = [3 + (salt + 7 * i) % 400 for i in range(100)]
        key = affinity_key(compute_block_hashes(prompt, BLOCK), prompt)
        if rendezvous_order(key, ["p-0", "p-1"])[0] == worker:
            return prompt
    raise AssertionError("none found")


def _decisions(metrics: RouterMetrics, kind: str, reason: str) -> float:
    value = metrics.registry.get_sample_value("pdserve:router_decisions_total",
                                              {"kind": kind, "reason": reason})
    return 0.0 if value is None else value


def test_the_worker_holding_the_prefix_wins_over_affinity() -> None:
    prompt = _prompt_by_affinity("p-0")
    hashes = compute_block_hashes(prompt, BLOCK)
    placement, metrics = _placement(prompt, _index({"p-1": hashes[:4]}), Pool())
    assert placement.prefill_order() == ["p-1", "p-0"]
    assert placement.prefill_tokens("p-1") == 100 - 4 * BLOCK
    assert _decisions(metrics, "prefill", "kv_hit") == 1
    # a migrated stream's attempt prefills the tokens it had sent too
    placement.ctx.calls.num_resumed = 30
    assert placement.prefill_tokens("p-1") == 130 - 4 * BLOCK
    # a decode worker that switched to prefill never prefills its own reservation
    assert placement.prefill_order("p-1") == ["p-0"]


def test_another_routers_queue_moves_it_elsewhere() -> None:
    prompt = _prompt_by_affinity("p-0")
    hashes = compute_block_hashes(prompt, BLOCK)
    # p-1 holds 4 blocks (64 tokens fewer to compute) but has 500 tokens queued
    placement, metrics = _placement(prompt, _index({"p-1": hashes[:4]}), Pool({"p-1": 500}))
    assert placement.prefill_order() == ["p-0", "p-1"]
    assert _decisions(metrics, "prefill", "kv_cost") == 1


def test_a_prompt_is_prefilled_on_the_decode_worker_when_every_prefill_queue_is_longer(
        ) -> None:
    prompt = _prompt_by_affinity("p-0")  # 100 tokens, none of them cached anywhere
    placement, _ = _placement(prompt, _index({}), Pool({"p-0": 1000, "p-1": 150}))
    assert placement.prefills_locally()
    assert placement._conditional() == "local_queue_wait"  # the reason counted
    # one prefill worker's queue is shorter than the prompt: it goes there (its side: the
    # queue and the 100 tokens; the decode worker's: the 100 tokens, twice)
    assert not _placement(prompt, _index({}), Pool({"p-0": 1000, "p-1": 90}))[0] \
        .prefills_locally()
    # local prefills under way on the decode worker (any router's) count on its side
    assert not _placement(prompt, _index({}), Pool({"p-0": 1000, "p-1": 150, "d-0": 60}))[0] \
        .prefills_locally()
    # conditional disaggregation off
    assert not _placement(prompt, _index({}), Pool({"p-0": 1000, "p-1": 150}),
                          local_prefill_max_tokens=0)[0].prefills_locally()
    # every worker holds 5 of its blocks: each lacks 20 tokens, and the queues decide (the
    # prefill workers' sides 50 and 45, the decode worker's 2 x 20)
    hashes = compute_block_hashes(prompt, BLOCK)
    index = _index({w: hashes[:5] for w in ("d-0", "p-0", "p-1")})
    placement, _ = _placement(prompt, index, Pool({"p-0": 30, "p-1": 25}),
                              local_prefill_max_tokens=8)
    assert placement._conditional() == "local_queue_wait"
    assert not _placement(prompt, index, Pool({"p-0": 30, "p-1": 20}),
                          local_prefill_max_tokens=8)[0].prefills_locally()
    # a migrated stream's attempt keeps the prefill path (as for a short tail)
    placement, _ = _placement(prompt, _index({}), Pool({"p-0": 1000, "p-1": 150}))
    placement.ctx.calls.num_resumed = 10
    assert not placement.prefills_locally()


def test_a_prefill_carries_the_queue_its_worker_may_refuse_it_over() -> None:
    prompt = _prompt_by_affinity("p-0")  # 100 tokens, none of them cached anywhere
    hashes = compute_block_hashes(prompt, BLOCK)
    # the local side: what the decode worker lacks, twice, plus its local prefills under
    # way; less what the prefill worker lacks (all of it here, then 4 blocks fewer)
    placement, _ = _placement(prompt, _index({"d-0": hashes[:2]}), Pool({"d-0": 30}))
    assert queue_limit(placement, "d-0", "p-0") == 2 * (100 - 2 * BLOCK) + 30 - 100
    placement, _ = _placement(prompt, _index({"d-0": hashes[:2], "p-0": hashes[:4]}),
                              Pool({"d-0": 30}))
    assert queue_limit(placement, "d-0", "p-0") == 2 * (100 - 2 * BLOCK) + 30 - (100 - 64)
    # at a slower worker's speed (1.5 x 100/400): the same wait is fewer of its tokens,
    # here fewer than the prompt, so it costs more than the decode worker even idle
    placement, _ = _placement(prompt, _index({}), Pool(rates={"p-0": 100.0, "p-1": 400.0}))
    assert int(2 * 100 * 1.5 * 100 / 400) < 100
    assert queue_limit(placement, "d-0", "p-0") == DEARER
    assert queue_limit(placement, "d-0", "p-1") == 2 * 100 - 100
    # KV this router saw land on the decode worker, not yet in the index, counts too
    placement, _ = _placement(prompt, _index({}), Pool({"d-0": 30}))
    placement.gate.recent.landed("d-0", hashes[:2])
    assert queue_limit(placement, "d-0", "p-0") == 2 * (100 - 2 * BLOCK) + 30 - 100
    # exactly as dear as the decode worker when idle (lacking 68 = 2 x 20 + 28 queued
    # there): an idle one may take it
    placement, _ = _placement(prompt, _index({"d-0": hashes[:5], "p-1": hashes[:2]}),
                              Pool({"d-0": 28}))
    assert queue_limit(placement, "d-0", "p-1") == 1
    # none where the router would never prefill it locally for its queue
    assert queue_limit(_placement(prompt, _index({}), Pool(), local_prefill_max_tokens=0)[0],
                       "d-0", "p-0") == 0
    assert queue_limit(_placement(prompt, _index({}), Pool(), prefill_routing="affinity")[0],
                       "d-0", "p-0") == 0
    placement, _ = _placement(prompt, _index({}), Pool())
    placement.ctx.calls.num_resumed = 10
    assert queue_limit(placement, "d-0", "p-0") == 0


def test_after_a_queue_refusal_the_next_attempt_prefills_on_the_decode_worker() -> None:
    prompt = _prompt_by_affinity("p-0")
    placement, _ = _placement(prompt, _index({}), Pool())
    assert not placement.prefills_locally()  # by the router's own view: no queue
    placement.ctx.local_reason = "local_queue_refused"  # what the handoff sets
    assert placement.prefills_locally()  # (the e2e test counts its reason, once)


def test_a_clearly_slower_prefill_worker_counts_its_tokens_for_more() -> None:
    prompt = _prompt_by_affinity("p-0")
    queued = {"p-0": 200, "p-1": 200}
    # equal queues: affinity decides while the rates reported are alike (noise), or
    # missing
    for rates in ({}, {"p-0": 100.0}, {"p-0": 100.0, "p-1": 140.0}):
        assert _placement(prompt, _index({}), Pool(queued, rates=rates))[0] \
            .prefill_order() == ["p-0", "p-1"]
    # p-0 computes at a quarter of p-1's rate: its 300 tokens take 4x as long
    placement, metrics = _placement(prompt, _index({}), Pool(queued, rates={
        "p-0": 100.0, "p-1": 400.0}))
    assert placement.prefill_order() == ["p-1", "p-0"]
    assert _decisions(metrics, "prefill", "kv_cost") == 1
    # and its queue counts for more toward conditional disaggregation's rule (speed 1.5
    # x 1/4): the prompt's 100 tokens take less on the decode worker than 40 queued on
    # p-0 (or 110 on p-1)
    queued = {"p-0": 40, "p-1": 110}
    assert not _placement(prompt, _index({}), Pool(queued))[0].prefills_locally()
    placement, _ = _placement(prompt, _index({}), Pool(queued, rates={
        "p-0": 100.0, "p-1": 400.0}))
    assert placement._conditional() == "local_queue_wait"


def test_an_untrusted_index_falls_back_to_affinity() -> None:
    prompt = _prompt_by_affinity("p-0")
    hashes = compute_block_hashes(prompt, BLOCK)
    stale = KVIndex(stale_after_s=-1.0)  # never trusted
    stale.watch(["p-1"])
    stale.apply(EventBatch("p-1", 1, 1, tuple((STORED, h) for h in hashes)))
    placement, metrics = _placement(prompt, stale, Pool())
    assert placement.prefill_order() == ["p-0", "p-1"]
    assert _decisions(metrics, "prefill", "index_stale") == 1
    placement, metrics = _placement(prompt, _index({"p-1": hashes}), Pool(),
                                    prefill_routing="affinity")
    assert placement.prefill_order() == ["p-0", "p-1"]
    assert _decisions(metrics, "prefill", "affinity") == 1


def test_a_short_tail_on_a_decode_worker_is_prefilled_there() -> None:
    prompt = _prompt_by_affinity("p-0")  # 100 tokens: 6 full blocks and 4
    hashes = compute_block_hashes(prompt, BLOCK)
    # all but 20 tokens, on the decode worker and (below) the prefill workers alike
    index = _index({"d-0": hashes[:5], "p-0": hashes[:5], "p-1": hashes[:5]})
    placement, _ = _placement(prompt, index, Pool(), local_prefill_max_tokens=32)
    assert placement._conditional() == "local_short_tail"
    assert not _placement(prompt, index, Pool(),
                          local_prefill_max_tokens=16)[0].prefills_locally()
    assert not _placement(prompt, index, Pool(),
                          local_prefill_max_tokens=0)[0].prefills_locally()  # 0: never
    assert _placement(prompt, index, Pool())[0].prefills_locally()  # the default: 64
    assert placement.decode_order() == ["d-0"]
    # the prefill workers lacking all 100 (more than twice 20), the queue rule keeps it
    # there even past the short tail's limit
    placement, _ = _placement(prompt, _index({"d-0": hashes[:5]}), Pool(),
                              local_prefill_max_tokens=16)
    assert placement._conditional() == "local_queue_wait"


def test_over_a_lossy_wire_decode_workers_are_matched_on_the_blocks_they_received() -> None:
    """``--kv-transfer-dtype int8``: a decode worker keys the blocks it received apart
    (salted); an attempt whose KV comes over the wire goes where its salted blocks are, a
    local prefill (which never reads them) where its plain ones are, and only those count
    towards a short tail."""
    prompt = _prompt_by_affinity("p-0")
    plain = compute_block_hashes(prompt, BLOCK)
    lossy = compute_block_hashes(prompt, BLOCK, salt=LOSSY_WIRE_SALT)
    index = _index({"d-0": plain[:2], "d-1": lossy[:5]})
    pool = Pool(decode=("d-0", "d-1"))
    placement, metrics = _placement(prompt, index, pool, LOSSY_WIRE_SALT)
    assert placement.decode_order() == ["d-1", "d-0"]
    assert _decisions(metrics, "decode", "kv_hit") == 1
    assert placement.decode_order(received=False) == ["d-0", "d-1"]
    assert not _placement(prompt, index, pool, LOSSY_WIRE_SALT,
                          local_prefill_max_tokens=32)[0].prefills_locally()
    # the same holdings without the salt in play: the plain blocks decide
    placement, _ = _placement(prompt, index, pool)
    assert placement.decode_order() == ["d-0", "d-1"]


def test_a_decode_worker_the_prompt_just_landed_on_ranks_first_before_the_index_says_so(
        ) -> None:
    """router.recent_kv: the KV index lists a chat's last turn a moment after it landed;
    its next turn, sent at once, still goes to that decode worker (and, within the load
    bound only, before one with less in flight)."""
    prompt = [3 + (7 * i) % 400 for i in range(100)]
    pool = Pool(decode=("d-0", "d-1"))
    placement, _ = _placement(prompt, _index({}), pool)
    assert placement.decode_order() == ["d-0", "d-1"]  # nothing known: by id
    placement.gate.recent.landed("d-1", compute_block_hashes(prompt[:32], BLOCK))
    assert placement.decode_order() == ["d-1", "d-0"]
    # the 2 blocks it shares with the prompt that landed (held, by recent_kv)
    assert placement._decode_held == {"d-0": 0, "d-1": 2}
    other = [5 + (11 * i) % 400 for i in range(100)]  # another first block: no hint
    placement, _ = _placement(other, _index({}), pool)
    placement.gate.recent.landed("d-1", compute_block_hashes(prompt[:32], BLOCK))
    assert placement.decode_order() == ["d-0", "d-1"]


def test_later_choices_prefill_on_choice_0s_decode_worker_unless_its_kv_came_lossy() -> None:
    # n > 1: the later choices prefill locally where choice 0's KV is; KV that crossed a
    # lossy wire is keyed apart there, so a local prefill would compute the whole prompt
    from router.lifecycle.context import SharedDecode

    prompt = _prompt_by_affinity("p-0")
    for lossy, shared in ((False, "d-0"), (True, None)):
        placement, _ = _placement(prompt, None, Pool(), LOSSY_WIRE_SALT if lossy else "")
        placement.ctx.shared_decode = SharedDecode()
        placement._share("d-0", lossy=lossy)
        assert placement.ctx.shared_decode.worker_id == shared, lossy
