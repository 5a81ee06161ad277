"""Decode-side prefix reuse through real processes: a decode worker's Reserve takes the
prompt blocks its prefix cache holds, and the prefill worker sends only the blocks after
them (``KVTarget.num_cached_blocks``). Redis, one prefill worker, two decode workers of
two tensor-parallel ranks each (every rank skips the same blocks), the router.

- the choices of an n = 3 request share choice 0's decode worker (the router asks it
  first): the later choices receive only the block of the prompt's last token, so the
  request moves 4 + 1 + 1 blocks against n = 1's 4, and each choice's tokens are what
  n = 1 gives for its seed;
- the same prompt again on a decode worker that holds it: its leading blocks are not
  sent, and the continuation equals the engine's.

Counted on the workers' metrics (``pdserve:kv_transfer_bytes_total``,
``pdserve:kv_blocks_reused_total``); every test ends with the cluster's leak check.
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


def _counts(cluster: Cluster) -> tuple[float, dict[str, float]]:
    """(KV bytes the prefill worker sent, blocks each decode worker reused)."""
    sent = scrape_metrics(cluster.prefill[0].ready["metrics_address"])[
        "pdserve:kv_transfer_bytes_total{direction=sent}"]
    reused = {d.name: scrape_metrics(d.ready["metrics_address"])[
        "pdserve:kv_blocks_reused_total{}"] for d in cluster.decode}
    return sent, reused


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
    bytes0, reused0 = _counts(cluster)
    single = client.complete(prompt_token_ids=[7 + i % 300 for i in range(60)], **knobs)
    bytes1, reused1 = _settled(cluster)
    prompt = [11 + (3 * i) % 400 for i in range(60)]  # 3 full blocks + 12 tokens
    several = client.complete(prompt_token_ids=prompt, n=3, **knobs)
    bytes3, reused3 = _settled(cluster)
    alone = [client.complete(prompt_token_ids=prompt, **{**knobs, "seed": 5 + i})
             for i in (1, 2)]
    assert single.usage.prompt_tokens == several.usage.prompt_tokens == 60
    assert _moved(reused1, reused0) == {}
    # one decode worker took all three choices; the later two reused 3 blocks each
    assert list(_moved(reused3, reused1).values()) == [2 * 3]
    assert (bytes3 - bytes1) * 4 == (bytes1 - bytes0) * (4 + 1 + 1)
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
