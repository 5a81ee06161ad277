"""KV-aware routing through real processes: the workers' KV events reach the routers'
indexes, and a prompt goes to the prefill worker that holds its prefix. Redis, two
prefill workers, one decode worker, the router (``--prefill-routing kv-aware``, the
default, serving metrics).

- a router started after the traffic resynchronises every worker from its snapshot and
  routes a repeated prefix to the worker that holds it, though rendezvous hashing of the
  prompt names the other worker;
- bad entries on the stream (an unknown worker, a hash of the wrong length, an epoch
  going backwards) are counted and ignored;
- routers see each other's load (``cluster.router_loads``): one with nothing in flight
  routes away from the prefill worker another router keeps busy;
- a prompt a decode worker holds all but a short tail of is prefilled there
  (``--local-prefill-max-tokens``), counted by reason, its tokens the engine's; so is
  one that every prefill worker's queue would keep waiting longer than it takes there,
  a chat's next turn whose reply only the decode worker holds (a prefill worker would
  compute it again), and one whose prefill worker refuses it for that (its router had not read the other
  router's load); and one that a prompt the router is bringing to the decode worker
  covers but a short tail, once that KV has landed there;
- a router that has not read the other router's load sends a Prefill to the worker that
  router keeps busy: over what the choice assumed (``router.policy.queue_bounds``), the
  worker refuses, and the idle one computes the prompt;
- after Redis restarts empty, the events flow again through the new stream;
- a lost batch (a sequence gap) makes the router resynchronise that worker; a worker
  restarted empty leaves the index (its new epoch).

Observed on the routers' metrics (``pdserve:router_kv_*``, ``pdserve:router_decisions_total``)
and the prefill workers' (``vllm:prompt_tokens_total``, ``vllm:prefix_cache_hits_total``);
every test ends with the cluster's leak check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from cluster.kv_events import BadEvent, EventBatch, decode, encode
from cluster.registry import Keys, Registry
from engine import LLM, SamplingParams
from engine.kvcache.block_hash import compute_block_hashes
from engine.kvcache.events import STORED
from pdserve import Client
from router.routing import affinity_key, rendezvous_order
from tests.e2e.cluster import Cluster, scrape_metrics
from tests.leaks import router_holdings
from tests.processes import Proc, wait_until

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
CLUSTER = {"num_prefill": 2, "num_decode": 1, "decode_tp": 1,
           "router_args": ("--metrics-port", "0")}
BLOCK = 16  # the workers' --block-size
STREAM = Keys().kv_events


def _metric(proc: Proc, name: str) -> float:
    return scrape_metrics(proc.ready["metrics_address"]).get(name, 0.0)


def _settled(read: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``read()`` once two reads 0.1 s apart agree (workers refresh figures when idle)."""
    last = read()
    for _ in range(50):
        time.sleep(0.1)
        if (now := read()) == last:
            return now
        last = now
    raise AssertionError(f"figures kept moving: {last}")


def _prefill_figures(cluster: Cluster) -> dict[str, float]:
    return {f"{p.name} {what}": _metric(p, f"vllm:{what}_total{{}}") for p in cluster.prefill
            for what in ("prompt_tokens", "prefix_cache_hits")}


def _indexed(router: Proc, worker: str) -> float:
    """Blocks ``router``'s KV index says ``worker`` holds, once it trusts the index."""
    if _metric(router, "pdserve:router_kv_index_trusted{}") != 1:
        return -1.0
    return _metric(router, f"pdserve:router_kv_index_worker_blocks{{worker={worker}}}")


def _complete(address: str, prompt: list[int]) -> list[int]:
    with Client(address) as client:
        return list(client.complete(prompt_token_ids=prompt, max_tokens=2, temperature=0.0,
                                    ignore_eos=True, timeout=TIMEOUT_S).token_ids)


def _complete_six(address: str, prompt: list[int]) -> Any:
    with Client(address) as client:
        return client.complete(prompt_token_ids=prompt, max_tokens=6, temperature=0.0,
                               ignore_eos=True, timeout=TIMEOUT_S)


def _engine_tokens(llama_dir: Path, prompt: list[int]) -> list[int]:
    """``engine.LLM``'s 6 greedy tokens for ``prompt``: what the cluster must stream."""
    with LLM(llama_dir) as llm:
        return list(llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0,
                                                          ignore_eos=True))[0].token_ids)


def _holder(cluster: Cluster, prompt: list[int]) -> str:
    """Send ``prompt`` through the cluster's router: the prefill worker that computed it."""
    before = _settled(lambda: _prefill_figures(cluster))
    _complete(cluster.address, prompt)
    after = _settled(lambda: _prefill_figures(cluster))
    grew = [p.name for p in cluster.prefill
            if after[f"{p.name} prompt_tokens"] > before[f"{p.name} prompt_tokens"]]
    assert len(grew) == 1, (before, after)
    return grew[0]


def _last_batch(cluster: Cluster, worker: str) -> EventBatch:
    client = redis.Redis.from_url(cluster.redis.url, socket_timeout=5)
    try:
        for _, fields in client.xrevrange(STREAM, count=2000):
            batch = decode(fields)
            if batch.worker_id == worker:
                return batch
    finally:
        client.close()
    raise AssertionError(f"no KV event of {worker} on the stream")


def _published(cluster: Cluster, worker: str, block_hash: bytes) -> bool:
    """Whether ``worker``'s KV events on the stream say it stored ``block_hash`` (entries
    that do not decode, as another test adds, are skipped)."""
    client = redis.Redis.from_url(cluster.redis.url, socket_timeout=5)
    try:
        for _, fields in client.xrevrange(STREAM, count=2000):
            try:
                batch = decode(fields)
            except BadEvent:
                continue
            if batch.worker_id == worker and (STORED, block_hash) in batch.ops:
                return True
        return False
    finally:
        client.close()


def _add(cluster: Cluster, fields: dict[str, bytes]) -> None:
    client = redis.Redis.from_url(cluster.redis.url, socket_timeout=5)
    try:
        client.xadd(STREAM, fields)  # type: ignore[arg-type]
    finally:
        client.close()


def test_a_late_router_routes_a_repeated_prefix_to_the_worker_that_holds_it(
        cluster: Cluster) -> None:
    assert cluster.router is not None
    base = [30 + (5 * i) % 500 for i in range(40)]  # 2 full blocks + 8 tokens
    holder = _holder(cluster, base)
    other = next(p.name for p in cluster.prefill if p.name != holder)
    wait_until(lambda: _indexed(cluster.router, holder) >= 2, 10.0,  # type: ignore[arg-type]
               "the router to index the prompt's blocks")
    # a longer prompt on that prefix whose rendezvous hashing names the other worker
    with Registry(cluster.redis.url) as registry:
        layout = registry.cluster_layout()
    assert layout is not None
    for start in range(200):
        prompt = base + [600 + (start + 3 * i) % 97 for i in range(60)]  # 6 blocks + 4
        hashes = compute_block_hashes(prompt, BLOCK, seed=layout.hash_seed)
        if rendezvous_order(affinity_key(hashes, prompt), [holder, other])[0] == other:
            break
    else:
        raise AssertionError("no prompt found whose affinity names the other worker")
    late = cluster.start_router("--metrics-port", "0", name="router-late")
    try:
        wait_until(lambda: _indexed(late, holder) >= 2, 15.0,
                   "the late router to resynchronise from the workers' snapshots")
        assert _metric(late, "pdserve:router_kv_resyncs_total{}") >= 3  # every worker
        before = _settled(lambda: _prefill_figures(cluster))
        _complete(late.address, prompt)
        after = _settled(lambda: _prefill_figures(cluster))
        assert after[f"{other} prompt_tokens"] == before[f"{other} prompt_tokens"]
        assert after[f"{holder} prefix_cache_hits"] - before[f"{holder} prefix_cache_hits"] \
            == 2 * BLOCK
        assert _metric(late, "pdserve:router_decisions_total{kind=prefill,reason=kv_hit}") == 1
    finally:
        late.stop()
    cluster.assert_no_leaks()


def test_bad_events_are_counted_and_ignored(cluster: Cluster) -> None:
    router = cluster.router
    assert router is not None
    victim = cluster.prefill[0].name
    last = _last_batch(cluster, victim)
    held = _indexed(router, victim)
    good = encode(EventBatch(victim, last.epoch, last.seq + 1, ()))
    _add(cluster, {**good, "w": b"ghost-worker"})
    _add(cluster, {**good, "o": b"S" + b"\x01" * 10})
    _add(cluster, {**good, "e": str(last.epoch - 1).encode(), "s": b"1"})
    for outcome in ("unknown_worker", "hash_length", "epoch_backwards"):
        wait_until(lambda o=outcome: _metric(  # type: ignore[misc]
            router, f"pdserve:router_kv_events_total{{outcome={o}}}") >= 1, 10.0,
            f"the router to count a {outcome} event")
    assert _indexed(router, victim) == held
    assert len(_complete(cluster.address, [3, 1, 4, 1, 5, 9, 2, 6])) == 2  # still serving
    cluster.assert_no_leaks()


def _fresh_prompt_routed_to(cluster: Cluster, worker: str, workers: list[str], salt: int,
                            num_tokens: int = 40) -> list[int]:
    """A prompt no test sent before whose affinity (all idle, nothing cached) is ``worker``."""
    with Registry(cluster.redis.url) as registry:
        layout = registry.cluster_layout()
    assert layout is not None
    for start in range(200):
        prompt = [400 + (salt * 31 + start + 13 * i) % 300 for i in range(num_tokens)]
        hashes = compute_block_hashes(prompt, BLOCK, seed=layout.hash_seed)
        if rendezvous_order(affinity_key(hashes, prompt), workers)[0] == worker:
            return prompt
    raise AssertionError(f"no prompt routes to {worker}")


def _random_prompt_routed_to(cluster: Cluster, worker: str, workers: list[str], seed: str,
                             num_tokens: int) -> list[int]:
    """A random prompt (sharing no block with any other test's) whose affinity (all idle,
    nothing cached) is ``worker``."""
    import random

    with Registry(cluster.redis.url) as registry:
        layout = registry.cluster_layout()
    assert layout is not None
    rng = random.Random(seed)
    for _ in range(200):
        prompt = [rng.randrange(100, 700) for _ in range(num_tokens)]
        hashes = compute_block_hashes(prompt, BLOCK, seed=layout.hash_seed)
        if rendezvous_order(affinity_key(hashes, prompt), workers)[0] == worker:
            return prompt
    raise AssertionError(f"no prompt routes to {worker}")


def test_routers_see_each_others_load(cluster: Cluster) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from cluster.pause_points import PauseDir

    assert cluster.router is not None
    names = [p.name for p in cluster.prefill]
    busy, idle = names
    held = _fresh_prompt_routed_to(cluster, busy, names, salt=1)
    asked = _fresh_prompt_routed_to(cluster, busy, names, salt=2)  # by affinity, busy's too
    late = cluster.start_router("--metrics-port", "0", name="router-shared-load")
    pause = PauseDir(cluster.pause_dir(busy))
    try:
        cluster.wait_serving()
        pause.arm("prefill.started")
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(_complete, cluster.address, held)
            pause.wait_paused("prefill.started", TIMEOUT_S)
            time.sleep(1.5)  # three refreshes: the first router's load is in Redis, read
            before = _prefill_figures(cluster)
            # the late router has nothing in flight itself: it routes away from the
            # worker the first router keeps busy only because it sees that router's load
            assert len(_complete(late.address, asked)) == 2
            routed = {w: _metric(late, f"pdserve:router_routed_total{{role=prefill,worker={w}}}")
                      for w in names}
            assert routed == {busy: 0.0, idle: 1.0}  # first time right, no retry
            after = _settled(lambda: {k: v for k, v in _prefill_figures(cluster).items()
                                      if k.startswith(idle)})
            assert after[f"{idle} prompt_tokens"] - before[f"{idle} prompt_tokens"] \
                == len(asked)
            pause.release("prefill.started")
            assert len(first.result(TIMEOUT_S)) == 2
    finally:
        pause.release("prefill.started")
        late.stop()
    cluster.assert_no_leaks()


def test_a_short_uncached_tail_is_prefilled_on_the_decode_worker(
        cluster: Cluster, llama_dir: Path) -> None:
    names = [p.name for p in cluster.prefill]
    first = _fresh_prompt_routed_to(cluster, names[0], names, salt=3)  # 2 blocks + 8
    turn = first + [7 + i for i in range(10)]  # the decode worker holds all but 18 tokens
    # the router's own default threshold (64), not the test clusters' 0
    router = cluster.start_router("--metrics-port", "0", name="router-local-tail", flags=())
    try:
        cluster.wait_serving()
        _complete(router.address, first)
        wait_until(lambda: _indexed(router, "decode-0") >= 2, 10.0,
                   "the router to index the decode worker's blocks")
        before = _settled(lambda: _prefill_figures(cluster))
        with Client(router.address) as client:
            got = client.complete(prompt_token_ids=turn, max_tokens=6, temperature=0.0,
                                  ignore_eos=True, timeout=TIMEOUT_S)
        assert _settled(lambda: _prefill_figures(cluster)) == before  # no prefill worker
        assert got.usage.cached_tokens == 2 * BLOCK  # the decode worker's own cache
        assert _metric(router, "pdserve:router_decisions_total"
                               "{kind=prefill,reason=local_short_tail}") == 1
    finally:
        router.stop()
    assert list(got.token_ids) == _engine_tokens(llama_dir, turn)
    cluster.assert_no_leaks()


def test_a_prompt_is_prefilled_on_the_decode_worker_while_every_prefill_queue_is_longer(
        cluster: Cluster, llama_dir: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from cluster.pause_points import PauseDir

    names = [p.name for p in cluster.prefill]
    longs = [_fresh_prompt_routed_to(cluster, name, names, salt=10 + i, num_tokens=120)
             for i, name in enumerate(names)]
    short = [500 + (7 * i) % 150 for i in range(20)]
    # the router's defaults (conditional disaggregation on), not the test clusters'
    router = cluster.start_router("--metrics-port", "0", name="router-queue-wait", flags=())
    pauses = [PauseDir(cluster.pause_dir(name)) for name in names]
    try:
        cluster.wait_serving()
        for pause in pauses:
            pause.arm("prefill.started")
        with ThreadPoolExecutor(2) as pool:
            # one long prompt held on each prefill worker: 120 tokens queued on both
            held = [pool.submit(_complete, router.address, prompt) for prompt in longs]
            for pause in pauses:
                pause.wait_paused("prefill.started", TIMEOUT_S)
            before = _prefill_figures(cluster)
            with Client(router.address) as client:
                got = client.complete(prompt_token_ids=short, max_tokens=6, temperature=0.0,
                                      ignore_eos=True, timeout=TIMEOUT_S)
            assert _metric(router, "pdserve:router_decisions_total"
                                   "{kind=prefill,reason=local_queue_wait}") == 1
            assert _prefill_figures(cluster) == before  # no prefill worker computed it
            for pause in pauses:
                pause.release("prefill.started")
            assert [len(h.result(TIMEOUT_S)) for h in held] == [2, 2]
        # each prefill worker reported the rate its full steps ran at (the router's speeds)
        for name in names:
            assert _metric(router, f"pdserve:router_worker_prefill_rate{{worker={name}}}") > 0
    finally:
        for pause in pauses:
            pause.release("prefill.started")
        router.stop()
    assert list(got.token_ids) == _engine_tokens(llama_dir, short)
    cluster.assert_no_leaks()


def test_a_chats_next_turn_stays_where_its_reply_is_rather_than_computed_again(
        cluster: Cluster, llama_dir: Path) -> None:
    """The decode worker holds a chat's first turn and the reply it generated; the prefill
    worker that computed the turn lacks the reply. The next turn's new part is too long
    for a short tail, and no prefill worker is busy, but every one would compute more than
    twice what the decode worker lacks: the decode worker prefills it."""
    import random

    rng = random.Random("next-turn")
    names = [p.name for p in cluster.prefill]
    first = _random_prompt_routed_to(cluster, names[0], names, "next-turn", 40)
    user = [rng.randrange(100, 700) for _ in range(72)]
    # the router's defaults (a short tail is at most 64 tokens), not the test clusters' 0
    router = cluster.start_router("--metrics-port", "0", name="router-next-turn", flags=())
    try:
        cluster.wait_serving()
        with Client(router.address) as client:
            reply = list(client.complete(prompt_token_ids=first, max_tokens=96,
                                         temperature=0.0, ignore_eos=True,
                                         timeout=TIMEOUT_S).token_ids)
        # 136 tokens: the decode worker holds 8 full blocks, the prefill worker 2
        turn = first + reply + user
        with Registry(cluster.redis.url) as registry:
            layout = registry.cluster_layout()
        assert layout is not None
        eighth = compute_block_hashes(turn, BLOCK, seed=layout.hash_seed)[7]
        wait_until(lambda: _published(cluster, "decode-0", eighth), 10.0,
                   "the decode worker to publish the reply's last full block")
        before = _settled(lambda: _prefill_figures(cluster))  # the router reads it meanwhile
        with Client(router.address) as client:
            got = client.complete(prompt_token_ids=turn, max_tokens=6, temperature=0.0,
                                  ignore_eos=True, timeout=TIMEOUT_S)
        # it lacks 208 - 128 = 80 (> 64); the prefill worker 176, more than 2 x 80
        assert _metric(router, "pdserve:router_decisions_total"
                               "{kind=prefill,reason=local_queue_wait}") == 1
        assert _settled(lambda: _prefill_figures(cluster)) == before  # no prefill worker
        assert got.usage.cached_tokens == 8 * BLOCK
    finally:
        router.stop()
    assert list(got.token_ids) == _engine_tokens(llama_dir, turn)
    cluster.assert_no_leaks()


def test_a_prefill_worker_refuses_a_prompt_its_queue_would_keep_waiting_longer(
        cluster: Cluster, llama_dir: Path) -> None:
    """A router that has not yet read the other router's load sends the Prefill: the
    prefill worker, holding the other router's long prompts, refuses it over the limit
    it carries, and the decode worker prefills it."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.pause_points import PauseDir

    names = [p.name for p in cluster.prefill]
    longs = [_fresh_prompt_routed_to(cluster, name, names, salt=20 + i, num_tokens=200)
             for i, name in enumerate(names)]
    short = [450 + (11 * i) % 150 for i in range(20)]
    # conditional disaggregation on (the router's defaults); the cluster's router has it off
    late = cluster.start_router("--metrics-port", "0", name="router-refused", flags=())
    pauses = [PauseDir(cluster.pause_dir(name)) for name in names]
    exchange = PauseDir(cluster.pause_dir("router-refused"))
    got = None
    try:
        cluster.wait_serving()
        exchange.arm("router.load_exchange")  # its view of the other router's load: none
        exchange.wait_paused("router.load_exchange", TIMEOUT_S)
        before = _settled(lambda: _prefill_figures(cluster))
        for pause in pauses:
            pause.arm("prefill.started")
        received = [len(p.records("prefill.received")) for p in pauses]

        def arrived(i: int) -> int:  # Prefills prefill worker i received since
            return len(pauses[i].records("prefill.received")) - received[i]

        with ThreadPoolExecutor(3) as pool:
            # the cluster's router holds a 200-token prompt on each prefill worker
            held = [pool.submit(_complete, cluster.address, prompt) for prompt in longs]
            for pause in pauses:
                pause.wait_paused("prefill.started", TIMEOUT_S)
            asked = pool.submit(_complete_six, late.address, short)
            # its Prefill reaches a prefill worker and waits there behind the held step;
            # refused there, it goes to the other, held until it is there too
            wait_until(lambda: arrived(0) + arrived(1) == 3, TIMEOUT_S,
                       "the late router's Prefill to reach a prefill worker")
            first = 0 if arrived(0) == 2 else 1
            pauses[first].release("prefill.started")
            wait_until(lambda: arrived(1 - first) == 2, TIMEOUT_S,
                       "the refused Prefill to reach the other prefill worker")
            pauses[1 - first].release("prefill.started")
            got = asked.result(TIMEOUT_S)
            assert [len(h.result(TIMEOUT_S)) for h in held] == [2, 2]
        assert _metric(late, "pdserve:router_decisions_total"
                             "{kind=prefill,reason=local_queue_refused}") == 1
        assert _metric(late, "pdserve:router_decisions_total"
                             "{kind=prefill,reason=local_queue_wait}") == 0
        assert _metric(late, "pdserve:router_attempts_total{}") == 2  # no retry spent
        # the first worker asked was over its bound, the next over the local side
        assert _metric(late, "pdserve:router_queue_refusals_total{limit=bound}") == 1
        assert _metric(late, "pdserve:router_queue_refusals_total{limit=local}") == 1
        after = _settled(lambda: _prefill_figures(cluster))
        computed = sum(after[f"{w} prompt_tokens"] - before[f"{w} prompt_tokens"]
                       for w in names)
        assert computed == 2 * 200  # the long prompts only: the short one was refused
    finally:
        for pause in pauses:
            pause.release("prefill.started")
        exchange.release("router.load_exchange")
        late.stop()
    assert got is not None and list(got.token_ids) == _engine_tokens(llama_dir, short)
    cluster.assert_no_leaks()


def test_a_prefill_worker_busier_than_the_router_saw_refuses_and_the_next_one_computes_it(
        cluster: Cluster, llama_dir: Path) -> None:
    """``router.policy.queue_bounds``: a router that has not read the other router's load
    sees every prefill worker idle and asks the first in its order, which holds the other
    router's long prompt. Its queue is within the decode worker's side of the limit (the
    queue rule alone would have it wait there), but over what this router's choice
    assumed: it refuses, and the idle worker computes the prompt at once."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.pause_points import PauseDir

    names = [p.name for p in cluster.prefill]
    held = _random_prompt_routed_to(cluster, names[0], names, "bounded", 200)
    # conditional disaggregation on (the router's defaults); the cluster's router has it off
    late = cluster.start_router("--metrics-port", "0", name="router-bounded", flags=())
    pauses = {w: PauseDir(cluster.pause_dir(w)) for w in names}
    exchange = PauseDir(cluster.pause_dir("router-bounded"))
    got = None
    try:
        cluster.wait_serving()
        wait_until(lambda: _metric(late, "pdserve:router_kv_index_trusted{}") == 1,
                   TIMEOUT_S, "the router's KV index to be trusted")
        exchange.arm("router.load_exchange")  # its view of the other router's load: none
        exchange.wait_paused("router.load_exchange", TIMEOUT_S)
        before = _settled(lambda: _prefill_figures(cluster))
        started = {w: len(pause.records("prefill.started")) for w, pause in pauses.items()}
        for pause in pauses.values():
            pause.arm("prefill.started")
        with ThreadPoolExecutor(2) as pool:
            # the cluster's router's choice (its figures of the workers' speeds may differ)
            first = pool.submit(_complete, cluster.address, held)
            wait_until(lambda: any(len(pause.records("prefill.started")) > started[w]
                                   for w, pause in pauses.items()), TIMEOUT_S,
                       "the long prompt's prefill to start")
            busy = next(w for w, pause in pauses.items()
                        if len(pause.records("prefill.started")) > started[w])
            idle = next(w for w in names if w != busy)
            pauses[idle].disarm("prefill.started")
            pauses[busy].wait_paused("prefill.started", TIMEOUT_S)  # 32 of 200 computed
            asked = _random_prompt_routed_to(cluster, busy, names, "bounded-asked", 200)
            received = len(pauses[busy].records("prefill.received"))
            second = pool.submit(_complete_six, late.address, asked)
            wait_until(lambda: len(pauses[busy].records("prefill.received")) > received,
                       TIMEOUT_S, "the late router's Prefill to reach the busy worker")
            # it runs one more 32-token step, then counts 136 queued: over the bound (16),
            # not over the local side (200)
            pauses[busy].release("prefill.started")
            got = second.result(TIMEOUT_S)
            assert len(first.result(TIMEOUT_S)) == 2
        routed = {w: _metric(late, f"pdserve:router_routed_total{{role=prefill,worker={w}}}")
                  for w in names}
        assert routed == {busy: 1.0, idle: 1.0}  # asked the busy one first, then the idle
        assert _metric(late, "pdserve:router_attempts_total{}") == 1  # no retry spent
        assert _metric(late, "pdserve:router_queue_refusals_total{limit=bound}") == 1
        assert _metric(late, "pdserve:router_queue_refusals_total{limit=local}") == 0
        for reason in ("local_short_tail", "local_queue_wait", "local_queue_refused"):
            assert _metric(late, "pdserve:router_decisions_total"
                                 f"{{kind=prefill,reason={reason}}}") == 0
        after = _settled(lambda: _prefill_figures(cluster))
        assert {w: after[f"{w} prompt_tokens"] - before[f"{w} prompt_tokens"]
                for w in names} == {busy: len(held), idle: len(asked)}
    finally:
        for pause in pauses.values():
            pause.release("prefill.started")
        exchange.release("router.load_exchange")
        late.stop()
    assert got is not None and list(got.token_ids) == _engine_tokens(llama_dir, asked)
    cluster.assert_no_leaks()


def test_a_prompt_waits_for_one_in_flight_covering_it_and_computes_its_tail_locally(
        cluster: Cluster, llama_dir: Path) -> None:
    """``router.lifecycle.coalesce``: the router is bringing a prompt to the decode worker
    that covers a second one but a short tail; the second waits for that KV to land, then
    the decode worker computes its tail: no prefill worker computes it, none of its KV
    travels."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster.pause_points import PauseDir

    names = [p.name for p in cluster.prefill]
    first = _fresh_prompt_routed_to(cluster, names[0], names, salt=30, num_tokens=64)
    second = first + [9 + i for i in range(12)]  # 4 blocks in flight, then 12 tokens
    router = cluster.start_router("--metrics-port", "0", name="router-coalesce", flags=())
    assert router.ready is not None
    debug = router.ready["debug_address"]
    pause, waits = PauseDir(cluster.pause_dir(names[0])), PauseDir(
        cluster.pause_dir("router-coalesce"))
    got = None
    try:
        cluster.wait_serving()
        wait_until(lambda: _metric(router, "pdserve:router_kv_index_trusted{}") == 1,
                   TIMEOUT_S, "the router's KV index to be trusted")
        before = _settled(lambda: _prefill_figures(cluster))
        sent_before = _metric(cluster.prefill[0], "pdserve:kv_transfer_bytes_total"
                                                  "{direction=sent}")
        pause.arm("prefill.started")
        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(_complete, router.address, first)
            pause.wait_paused("prefill.started", TIMEOUT_S)
            asked = pool.submit(_complete_six, router.address, second)
            wait_until(lambda: len(waits.records("router.prefix_wait")) == 1, TIMEOUT_S,
                       "the second request to wait for the first's KV")
            assert router_holdings(debug).prompts_in_flight == 1  # the first's: waited for
            pause.release("prefill.started")
            got = asked.result(TIMEOUT_S)
            assert len(held.result(TIMEOUT_S)) == 2
        wait_until(lambda: router_holdings(debug).prompts_in_flight == 0, TIMEOUT_S,
                   "the router to forget the prompt in flight")
        assert _metric(router, "pdserve:router_prefix_waits_total{outcome=landed}") == 1
        assert _metric(router, "pdserve:router_decisions_total"
                               "{kind=prefill,reason=local_short_tail}") == 1
        after = _settled(lambda: _prefill_figures(cluster))
        assert sum(after[f"{w} prompt_tokens"] - before[f"{w} prompt_tokens"]
                   for w in names) == len(first)  # the second: on the decode worker only
        sent = _metric(cluster.prefill[0], "pdserve:kv_transfer_bytes_total{direction=sent}")
        assert sent > sent_before  # the first's KV, once
        assert got is not None and got.usage.cached_tokens == len(first)
    finally:
        pause.release("prefill.started")
        router.stop()
    assert list(got.token_ids) == _engine_tokens(llama_dir, second)
    cluster.assert_no_leaks()


def test_after_redis_restarts_empty_the_events_flow_again(cluster: Cluster) -> None:
    router = cluster.router
    assert router is not None
    names = [p.name for p in cluster.prefill]
    before = _settled(lambda: _prefill_figures(cluster))
    cluster.redis.restart()  # the stream, the load keys, the registrations: all gone
    cluster.wait_serving()
    # a new prompt's blocks, published on the new stream, reach the index
    prompt = _fresh_prompt_routed_to(cluster, names[1], names, salt=4)
    held = {n: _indexed(router, n) for n in names}
    _complete(cluster.address, prompt)
    after = _settled(lambda: _prefill_figures(cluster))
    holder = next(n for n in names if after[f"{n} prompt_tokens"] > before[f"{n} prompt_tokens"])
    wait_until(lambda: _indexed(router, holder) >= held[holder] + 2, 15.0, "the router to index blocks published after Redis restarted")
    cluster.assert_no_leaks()


def test_a_gap_resyncs_and_a_restarted_worker_leaves_the_index(cluster: Cluster) -> None:
    router = cluster.router
    assert router is not None
    prompt = [60 + (11 * i) % 600 for i in range(50)]  # 3 full blocks + 2 tokens
    holder = _holder(cluster, prompt)
    wait_until(lambda: _indexed(router, holder) >= 3, 10.0, "the router to index the prompt")
    resyncs = _metric(router, "pdserve:router_kv_resyncs_total{}")
    last = _last_batch(cluster, holder)
    # a batch from later on: the ones between were lost, so the router asks for a snapshot
    _add(cluster, encode(EventBatch(holder, last.epoch, last.seq + 5, ())))
    wait_until(lambda: _metric(router, "pdserve:router_kv_resyncs_total{}") > resyncs, 10.0,
               "the router to resynchronise the worker after a gap")
    assert _metric(router, "pdserve:router_kv_events_total{outcome=gap}") >= 1
    assert _indexed(router, holder) >= 3  # the snapshot has the prompt's blocks
    # the worker restarts (same id, empty cache): its blocks leave the index
    index = next(i for i, p in enumerate(cluster.prefill) if p.name == holder)
    cluster.prefill.pop(index).stop()
    cluster.start_worker("prefill", index).wait_ready()
    cluster.wait_serving()
    wait_until(lambda: _indexed(router, holder) == 0, 15.0,
               "the router to forget the restarted worker's blocks")
    assert len(_complete(cluster.address, prompt)) == 2
    cluster.assert_no_leaks()
