"""Speculative decoding on a decode worker, through real processes: Redis, a prefill
worker, a decode worker started with ``--speculative-config`` (n-gram lookup), the
router. Greedy and seeded streams through the SDK equal ``engine.LLM``'s without
speculation token for token, and the decode worker counts the tokens it guessed and
kept (``vllm:spec_decode_num_*_tokens_total``). The module's leak check ends the test."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve import Client
from tests.e2e.cluster import Cluster, scrape_metrics

pytestmark = pytest.mark.timeout(240)

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_args": ("--speculative-config", NGRAM)}
PARAMS = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=64, temperature=0.8, seed=3, ignore_eos=True)]
DRAFTS = "vllm:spec_decode_num_draft_tokens_total{}"
KEPT = "vllm:spec_decode_num_accepted_tokens_total{}"


def assert_streams_as_plain(client: Client, model_dir: Path, prompts: list[str],
                            params: list[SamplingParams]) -> None:
    """Each prompt streamed with each of ``params`` gives ``engine.LLM``'s tokens."""
    with LLM(model_dir, max_num_batched_tokens=32) as llm:
        expected = [[llm.generate([prompt], p)[0].token_ids for prompt in prompts]
                    for p in params]
    got = [[list(client.complete(prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                                 seed=p.seed, ignore_eos=True).token_ids) for prompt in prompts]
           for p in params]
    assert got == expected


def guess_counters(cluster: Cluster) -> tuple[float, float]:
    """The decode worker's guessed and kept tokens, once it reported some kept."""
    for _ in range(40):  # the worker refreshes its counters as its loop goes idle
        figures = scrape_metrics(cluster.decode[0].ready["metrics_address"])
        if figures[KEPT] > 0:
            break
        time.sleep(0.05)
    return figures[DRAFTS], figures[KEPT]


def test_a_speculating_decode_worker_streams_the_tokens_of_plain_decoding(
        client: Client, cluster: Cluster, llama_dir: Path) -> None:
    assert_streams_as_plain(client, llama_dir,
                            ["one two three four one two three four one two three",
                             "the cat sat on the mat, the cat sat on the mat, the cat"], PARAMS)
    drafted, kept = guess_counters(cluster)
    assert drafted > kept > 0
