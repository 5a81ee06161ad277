"""Decode workers that speculate differently share one cluster, and a stream moves between
them unchanged, through real processes: Redis, a prefill worker with no speculative
config, decode-0 guessing by n-gram lookup, decode-1 with a draft model (the target
itself), the router. Speculation changes no greedy or seeded token
(``engine.core.speculative``), so the speculative config is each worker's own choice
and not part of the cluster's fingerprint: all three join. Streams that lose their
decode worker (SIGKILL, mid-stream) continue on the other one, which speculates another
way, and still equal ``engine.LLM``'s without speculation token for token. The module's
leak check ends the test."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve import AsyncClient
from tests.e2e.cluster import Cluster, scrape_metrics, start_cluster
from tests.e2e.test_speculative import DRAFTS, KEPT
from tests.processes import Proc

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 192
KILL_AFTER = 12  # every stream has this many tokens when its worker dies
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
PROMPTS = ["one two three four one two three four one two three",
           "the cat sat on the mat, the cat sat on the mat, the cat",
           "a b c d e f a b c d e f a b c",
           "red green blue red green blue red green"]
PARAMS = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True)]


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    draft = json.dumps({"method": "draft_model", "model": str(llama_dir),
                        "num_speculative_tokens": 3})
    with start_cluster(llama_dir, tmp_path_factory.mktemp("mixed_speculation"),
                       num_prefill=1, num_decode=1, decode_tp=1, decode_kv_blocks=200,
                       decode_args=("--speculative-config", NGRAM),
                       router_args=("--metrics-port", "0")) as c:
        c.start_worker("decode", 1, "--num-kv-blocks", "200",
                       "--speculative-config", draft).wait_ready()
        c.wait_serving()
        yield c


def _guesses(worker: Proc, kept_some: bool = False) -> tuple[float, float]:
    """The decode worker's guessed and kept tokens (``kept_some``: once it reported some
    kept: it refreshes its counters as its loop goes idle)."""
    for _ in range(40):
        figures = scrape_metrics(worker.ready["metrics_address"])
        if not kept_some or figures[KEPT] > 0:
            break
        time.sleep(0.05)
    return figures[DRAFTS], figures[KEPT]


def _migrations(cluster: Cluster) -> float:
    assert cluster.router is not None
    address = cluster.router.ready["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:migrations_total"))


def test_streams_keep_their_tokens_moving_between_workers_that_speculate_differently(
        cluster: Cluster, llama_dir: Path) -> None:
    with LLM(llama_dir, max_num_batched_tokens=32) as llm:
        expected = [r.token_ids for r in llm.generate(PROMPTS, PARAMS)]
    received: list[list[int]] = [[] for _ in PROMPTS]
    done = [False for _ in PROMPTS]
    held: dict[str, int] = {}

    async def one(client: AsyncClient, i: int) -> None:
        p = PARAMS[i]
        async for chunk in client.generate(PROMPTS[i], max_tokens=p.max_tokens,
                                           temperature=p.temperature, seed=p.seed,
                                           ignore_eos=True, timeout=120.0):
            received[i] += chunk.token_ids
        done[i] = True

    async def kill_the_busier_worker() -> None:
        while any(len(r) < KILL_AFTER and not done[i] for i, r in enumerate(received)):
            await asyncio.sleep(0.002)
        counts = await asyncio.to_thread(
            lambda: {w.name: len(cluster.info(w).attempt_ids) for w in cluster.decode})
        held.update(counts)
        victim = max(cluster.decode, key=lambda w: counts[w.name])
        victim.stop(sig=9)

    async def run() -> None:
        async with AsyncClient(cluster.address) as client:
            killer = asyncio.ensure_future(kill_the_busier_worker())
            try:
                await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))
            except BaseException:
                killer.cancel()
                raise
            await killer

    before = _migrations(cluster)
    guessed_before = {w.name: _guesses(w) for w in cluster.decode}
    asyncio.run(run())
    assert max(held.values()) >= 1, held  # a stream was on the worker that died
    assert received == expected  # nothing twice, nothing missing, nothing changed
    assert _migrations(cluster) - before >= 1
    [survivor] = [w for w in cluster.decode if w.proc.poll() is None]
    drafted, kept = (after - was for after, was in zip(_guesses(survivor, kept_some=True),
                                                        guessed_before[survivor.name],
                                                        strict=True))
    assert drafted > kept > 0  # the worker the streams moved to speculated
