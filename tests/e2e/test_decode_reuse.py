"""Decode-side prefix reuse through real processes: a decode worker's Reserve takes the
prompt blocks its prefix cache holds, and the prefill worker sends only the blocks after
them (``KVTarget.num_cached_blocks``). Redis, one prefill worker, two decode workers of
two tensor-parallel ranks each (every rank skips the same blocks), the router.

- the later choices of an n = 3 request prefill locally on choice 0's decode worker,
  whose prefix cache holds their prompt but for its last token's block: the request
  moves the KV of n = 1 and computes its prompt on the prefill worker once, and each
  choice's tokens are what n = 1 gives for its seed;
- the same prompt again on a decode worker that holds it: its leading blocks are not
  sent, and the continuation equals the engine's.

Counted on the workers' metrics (``pdserve:kv_transfer_bytes_total``,
``pdserve:kv_blocks_reused_total``, ``vllm:prompt_tokens_total``,
``vllm:prefix_cache_hits_total``); every test ends with the cluster's leak check.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from pdserve import Client
from tests.e2e.cluster import Cluster, scrape_metrics

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
CLUSTER = {"num_prefill": 1, "num_decode": 2, "decode_tp": 2}
BLOCK = 16  # the workers' --block-size


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir) as engine:
        yield engine


def _figures(cluster: Cluster, prefill_metric: str, decode_metric: str
             ) -> tuple[float, dict[str, float]]:
    """(the prefill worker's ``prefill_metric``, each decode worker's ``decode_metric``)."""
    on_prefill = scrape_metrics(cluster.prefill[0].ready["metrics_address"])[prefill_metric]
    return on_prefill, {d.name: scrape_metrics(d.ready["metrics_address"])[decode_metric]
                        for d in cluster.decode}


def _counts(cluster: Cluster) -> tuple[float, dict[str, float]]:
    """(KV bytes the prefill worker sent, blocks each decode worker reused)."""
    return _figures(cluster, "pdserve:kv_transfer_bytes_total{direction=sent}",
                    "pdserve:kv_blocks_reused_total{}")


def _prompt_tokens(cluster: Cluster) -> tuple[float, dict[str, float]]:
    """(prompt tokens the prefill worker computed, prefix-cache hits of each decode
    worker's own prefills)."""
    return _figures(cluster, "vllm:prompt_tokens_total{}", "vllm:prefix_cache_hits_total{}")


def _settled(cluster: Cluster) -> tuple[float, dict[str, float]]:
    """``_counts`` once two reads agree: the prefill worker's snapshot of its ranks'
    totals is taken as its loop goes idle, just after the request's transfer ended."""
    last = _counts(cluster)
    for _ in range(40):
        time.sleep(0.05)
        if (now := _counts(cluster)) == last:
            return now
        last = now
    raise AssertionError(f"the workers' KV figures kept moving: {last}")


def _moved(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def test_n_choices_move_the_prompt_kv_once(cluster: Cluster, client: Client) -> None:
    knobs: dict[str, Any] = dict(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True,
                                 timeout=TIMEOUT_S)
    bytes0, _ = _counts(cluster)
    computed0, _ = _prompt_tokens(cluster)
    single = client.complete(prompt_token_ids=[7 + i % 300 for i in range(60)], **knobs)
    bytes1, reused1 = _settled(cluster)
    computed1, hits1 = _prompt_tokens(cluster)
    prompt = [11 + (3 * i) % 400 for i in range(60)]  # 3 full blocks + 12 tokens
    several = client.complete(prompt_token_ids=prompt, n=3, **knobs)
    bytes3, reused3 = _settled(cluster)
    computed3, hits3 = _prompt_tokens(cluster)
    alone = [client.complete(prompt_token_ids=prompt, **{**knobs, "seed": 5 + i})
             for i in (1, 2)]
    assert single.usage.prompt_tokens == several.usage.prompt_tokens == 60
    # the prompt computed on the prefill worker and its KV moved once, as for n = 1 ...
    assert computed1 - computed0 == computed3 - computed1 == 60
    assert bytes3 - bytes1 == bytes1 - bytes0 > 0
    assert _moved(reused3, reused1) == {}
    # ... and the later two choices found 3 of its blocks on one decode worker
    assert list(_moved(hits3, hits1).values()) == [2 * 3 * BLOCK]
    assert [list(c.token_ids) for c in several.choices[1:]] == [
        list(a.token_ids) for a in alone]
    cluster.assert_no_leaks()


def test_a_prompt_the_decode_worker_holds_continues_like_the_engine(
        cluster: Cluster, client: Client, llm: LLM) -> None:
    prompt = [20 + (7 * i) % 500 for i in range(41)]  # 2 full blocks + 9 tokens
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].token_ids
    reuses = []
    for _ in range(4):  # 4 requests on 2 decode workers: at most 2 find it new
        _, before = _counts(cluster)
        got = client.complete(prompt_token_ids=prompt, max_tokens=8, temperature=0.0,
                              ignore_eos=True, timeout=TIMEOUT_S)
        assert list(got.token_ids) == expected
        _, after = _counts(cluster)
        reuses.append(sum(_moved(after, before).values()))
    assert set(reuses) <= {0, 41 // BLOCK} and reuses.count(41 // BLOCK) >= 2, reuses
    cluster.assert_no_leaks()
