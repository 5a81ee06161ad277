"""Planned moves keep the KV: a decode worker drained (SIGTERM) under 8 concurrent streams
while another decode worker serves (then again through a colocated router, between
decode workers of TP 1 and TP 2: the KV re-sharded on its way). Its decoding requests park with their KV and the
router moves each to the other decode worker, where the draining worker sends the KV it
holds (``cluster.moves``): every stream comes out whole and right — greedy, penalised
and seeded tokens, and text with a stop string, equal to ``engine.LLM``'s unfaulted run —
each move counted, none replayed (the prefill worker computes nothing for them), the
drained worker exits cleanly, and nothing is held afterwards (the module's leak check).
"""

from __future__ import annotations

import asyncio
import signal
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve import AsyncClient
from tests.e2e.cluster import Cluster
from tests.factories import PROMPTS
from tests.processes import Proc

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 120.0
MAX_TOKENS = 600  # long enough that no stream ends before the drain or switch acts
DRAIN_AFTER = 16  # every stream has this many tokens when the worker drains
CLUSTER = {"num_prefill": 1, "num_decode": 2, "decode_tp": 1, "decode_kv_blocks": 400,
           "router_args": ("--metrics-port", "0"), "decode_args": ("--grace", "20")}


def _metrics(cluster: Cluster, router: Proc | None = None) -> dict[str, float]:
    router = router or cluster.router
    assert router is not None
    address = router.ready["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_a_draining_decode_worker_moves_its_streams_with_their_kv(cluster: Cluster,
                                                                  llama_dir: Path) -> None:
    prompts = [f"{PROMPTS[i % 4]} (moving {i})" for i in range(8)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
              if i < 6 else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.75, seed=i,
                                           ignore_eos=True) for i in range(8)]
    for i in (2, 3, 7):  # penalties count the output before the move as output
        params[i] = replace(params[i], presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=1.25)
    with LLM(llama_dir) as llm:
        free = llm.generate(prompts[4:5], params[4:5])[0]
        params[4] = replace(params[4], stop=(free.text[len(free.text) * 3 // 4:][:6],))
        expected = llm.generate(prompts, params)
    victim = cluster.decode[0]
    received: list[list[int]] = [[] for _ in prompts]
    texts = ["" for _ in prompts]
    ends: list[str | None] = [None for _ in prompts]
    held: list[int] = []
    prefilled: list[int] = []

    async def one(client: AsyncClient, i: int) -> None:
        p = params[i]
        async for chunk in client.generate(
                prompts[i], max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                stop=list(p.stop), ignore_eos=True, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                timeout=TIMEOUT_S):
            received[i] += chunk.token_ids
            texts[i] += chunk.text
            ends[i] = chunk.finish_reason or ends[i]

    async def drain_when_all_have_streamed() -> None:
        while any(len(r) < DRAIN_AFTER and ends[i] is None for i, r in enumerate(received)):
            await asyncio.sleep(0.005)
        held.append(len((await asyncio.to_thread(cluster.info, victim)).attempt_ids))
        prefilled.append((await asyncio.to_thread(cluster.info, cluster.prefill[0])
                          ).num_started_requests)
        victim.proc.send_signal(signal.SIGTERM)

    async def run() -> None:
        async with AsyncClient(cluster.address) as client:
            drainer = asyncio.ensure_future(drain_when_all_have_streamed())
            try:
                await asyncio.gather(*(one(client, i) for i in range(8)))
            finally:
                drainer.cancel()

    before = _metrics(cluster)
    asyncio.run(run())
    assert victim.proc.wait(60) == 0, victim.log_tail()
    for i, result in enumerate(expected):
        assert received[i] == result.token_ids, i  # nothing twice, nothing missing
        assert texts[i] == result.text, i
        assert ends[i] == result.finish_reason, i
    assert ends[4] == "stop"
    after = _metrics(cluster)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    moved = delta('pdserve:kv_moves_total{outcome="moved"}')
    assert held and 1 <= moved == held[0], (moved, held, victim.log_tail(3000))
    assert delta('pdserve:kv_moves_total{outcome="replayed"}') == 0
    assert delta('pdserve:migrations_total{cause="draining"}') == moved
    # none recomputed: the prefill worker started no request after the drain began
    assert cluster.info(cluster.prefill[0]).num_started_requests == prefilled[0]
    assert "requests offered to move, 0 still pending" in victim.log_tail(20_000)
    cluster.decode.remove(victim)


def test_in_colocated_mode_a_drained_worker_s_streams_move_too(cluster: Cluster,
                                                              llama_dir: Path) -> None:
    # a router that prefills on the decode workers (--local-prefill always) takes the
    # offer too: the continuation is reserved on the other decode worker (no prefill
    # worker), whose TP size differs: the KV is re-sharded in transit, TP 1 <-> TP 2. With
    # migration off: a planned move is no failure, and does not count against the limit
    cluster.start_worker("decode", 2, "--num-kv-blocks", "400", "--grace", "20",
                         "--tensor-parallel-size", "2").wait_ready()
    router = cluster.start_router("--metrics-port", "0", "--local-prefill", "always",
                                  "--migration-limit", "0", name="router-colocated")
    cluster.wait_serving()
    prompts = [f"{PROMPTS[i % 4]} (colocated {i})" for i in range(6)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as llm:
        expected = [r.token_ids for r in llm.generate(prompts, params)]
    received: list[list[int]] = [[] for _ in prompts]
    held: dict[str, int] = {}

    async def one(client: AsyncClient, i: int) -> None:
        async for chunk in client.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True, timeout=TIMEOUT_S):
            received[i] += chunk.token_ids

    async def drain() -> None:
        while any(len(r) < DRAIN_AFTER for r in received):
            await asyncio.sleep(0.005)
        for worker in cluster.decode:
            held[worker.name] = len((await asyncio.to_thread(cluster.info, worker)).attempt_ids)
        victim = max(cluster.decode, key=lambda w: held[w.name])
        held["victim"] = held[victim.name]
        victim.proc.send_signal(signal.SIGTERM)
        cluster.decode.remove(victim)
        assert victim.proc.wait(60) == 0, victim.log_tail()

    async def run() -> None:
        async with AsyncClient(router.address) as client:
            drainer = asyncio.ensure_future(drain())
            await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
            await drainer

    before = _metrics(cluster, router)
    asyncio.run(run())
    assert received == expected
    moved = _metrics(cluster, router).get('pdserve:kv_moves_total{outcome="moved"}', 0.0) \
        - before.get('pdserve:kv_moves_total{outcome="moved"}', 0.0)
    assert held["victim"] >= 1 and moved == held["victim"], (moved, held)


def test_a_switch_to_prefill_can_move_the_worker_s_streams_with_their_kv(
        cluster: Cluster, llama_dir: Path) -> None:
    # SetRole(prefill, move_decoding): the worker's decoding streams move to the other
    # decode worker at once, instead of finishing there (what the planner asks for)
    from cluster.internal.v1 import worker_pb2 as wpb

    cluster.start_worker("decode", 3, "--num-kv-blocks", "400").wait_ready()
    cluster.wait_serving()
    prompts = [f"{PROMPTS[i % 4]} (switched {i})" for i in range(6)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as llm:
        expected = [r.token_ids for r in llm.generate(prompts, params)]
    received: list[list[int]] = [[] for _ in prompts]
    held: dict[str, int] = {}
    switched: list[Proc] = []

    async def one(client: AsyncClient, i: int) -> None:
        async for chunk in client.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True, timeout=TIMEOUT_S):
            received[i] += chunk.token_ids

    def switch() -> None:
        counts = {w.name: len(cluster.info(w).attempt_ids) for w in cluster.decode}
        worker = max(cluster.decode, key=lambda w: counts[w.name])
        held.update(counts)
        reply = cluster.stub(worker).SetRole(
            wpb.SetRoleRequest(role="prefill", move_decoding=True), timeout=30)
        assert (reply.previous_role, reply.role) == ("decode", "prefill")
        switched.append(worker)

    async def run() -> None:
        async with AsyncClient(cluster.address) as client:
            async def switch_when_all_have_streamed() -> None:
                while any(len(r) < DRAIN_AFTER for r in received):
                    await asyncio.sleep(0.005)
                await asyncio.to_thread(switch)
            switcher = asyncio.ensure_future(switch_when_all_have_streamed())
            await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
            await switcher

    before = _metrics(cluster)
    asyncio.run(run())
    assert received == expected
    worker = switched[0]
    moved = _metrics(cluster).get('pdserve:kv_moves_total{outcome="moved"}', 0.0) \
        - before.get('pdserve:kv_moves_total{outcome="moved"}', 0.0)
    assert held[worker.name] >= 1 and moved == held[worker.name], (moved, held)
    assert not cluster.info(worker).attempt_ids  # nothing of the old role is left there
    assert "switched to prefill: " in worker.log_tail(20_000)
    cluster.stub(worker).SetRole(wpb.SetRoleRequest(role="decode"), timeout=30)


def test_a_move_that_cannot_happen_is_replayed(cluster: Cluster, llama_dir: Path) -> None:
    # --grace 0: the parked requests' offers end at once, so each move the router asks
    # for is refused or fails, and the stream is replayed (through the prefill worker)
    from cluster.internal.v1 import worker_pb2 as wpb

    old = list(cluster.decode)
    for worker in old:  # every stream goes to the two new decode workers
        cluster.stub(worker).SetRole(wpb.SetRoleRequest(role="prefill"), timeout=30)
    victim = cluster.start_worker("decode", 4, "--num-kv-blocks", "400", "--grace", "0")
    cluster.start_worker("decode", 5, "--num-kv-blocks", "400").wait_ready()
    victim.wait_ready()
    cluster.wait_serving()
    # no two prompts share a first block: the router spreads them by load alone
    prompts = [f"replayed stream {i}: {PROMPTS[i % 4]}" for i in range(6)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as llm:
        expected = [r.token_ids for r in llm.generate(prompts, params)]
    received: list[list[int]] = [[] for _ in prompts]
    held: list[int] = []

    async def one(client: AsyncClient, i: int) -> None:
        async for chunk in client.generate(prompts[i], max_tokens=MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True, timeout=TIMEOUT_S):
            received[i] += chunk.token_ids

    async def drain() -> None:
        while any(len(r) < DRAIN_AFTER for r in received):
            await asyncio.sleep(0.005)
        held.append(len((await asyncio.to_thread(cluster.info, victim)).attempt_ids))
        victim.proc.send_signal(signal.SIGTERM)

    async def run() -> None:
        async with AsyncClient(cluster.address) as client:
            drainer = asyncio.ensure_future(drain())
            await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
            await drainer

    before = _metrics(cluster)
    asyncio.run(run())
    assert victim.proc.wait(60) == 0, victim.log_tail()
    cluster.decode.remove(victim)
    assert received == expected
    after = _metrics(cluster)

    def delta(outcome: str) -> float:
        key = f'pdserve:kv_moves_total{{outcome="{outcome}"}}'
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert held[0] >= 1 and delta("replayed") == held[0] and delta("moved") == 0, (
        held, delta("replayed"), delta("moved"))
    for worker in old:
        cluster.stub(worker).SetRole(wpb.SetRoleRequest(role="decode"), timeout=30)
