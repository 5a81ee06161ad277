"""A decode worker speculating with a draft model, through real processes: Redis, a
prefill worker, a decode worker started with ``--speculative-config`` naming a draft
checkpoint (the target itself, so that right draft KV shows as guesses kept), the router.
The decode worker receives the target's prompt KV from the prefill worker and computes
the draft's itself (``engine.core.drafter``). Greedy and seeded streams through the SDK
equal ``engine.LLM``'s without speculation token for token; the worker counts the guesses
and the kept ones. The module's leak check ends the test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve import Client
from tests.e2e.cluster import Cluster, scrape_metrics, start_cluster
from tests.e2e.test_speculative import DRAFTS, assert_streams_as_plain, guess_counters

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, temperature=0.8, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One prefill and one decode worker; the decode worker drafts with the target."""
    spec = json.dumps({"method": "draft_model", "model": str(llama_dir),
                       "num_speculative_tokens": 4})
    with start_cluster(llama_dir, tmp_path_factory.mktemp("draft_model"), num_prefill=1,
                       num_decode=1, decode_tp=1,
                       decode_args=("--speculative-config", spec)) as c:
        yield c


def test_a_decode_worker_with_a_draft_model_streams_the_tokens_of_plain_decoding(
        client: Client, cluster: Cluster, llama_dir: Path) -> None:
    assert_streams_as_plain(client, llama_dir, ["one two three four five six seven",
                                                "the cat sat on the mat and then"],
                            [GREEDY, SEEDED])
    drafted, kept = guess_counters(cluster)
    # the greedy streams' guesses (about 2 × 47 tokens' worth) are all kept: the draft
    # KV the decode worker computed for the prompt it received is right
    assert drafted >= kept >= 80


def test_a_prompt_the_decode_worker_prefills_itself_guesses_at_its_first_step(
        cluster: Cluster, llama_dir: Path) -> None:
    """A router that prefills on the decode worker (``--local-prefill always``): the
    draft computes the prompt's KV in the steps that prefill it, so a 4-token request of a
    long prompt guesses at its first decode step (caught up 64 tokens a step, its three
    decode steps would guess nothing); its tokens are plain decoding's."""
    prompt = " ".join(f"w{i}" for i in range(120))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as llm:
        assert len(llm.encode(prompt)) > 3 * 64
        expected = llm.generate([prompt], params)[0].token_ids
    drafted_before = scrape_metrics(cluster.decode[0].ready["metrics_address"])[DRAFTS]
    router = cluster.start_router("--local-prefill", "always", name="router-colocated")
    try:
        with Client(router.address) as client:
            got = client.complete(prompt, max_tokens=4, temperature=0.0, ignore_eos=True,
                                  timeout=60)
    finally:
        router.stop()
        cluster.routers.remove(router)
    assert list(got.token_ids) == expected
    for _ in range(40):  # the worker refreshes its counters as its loop goes idle
        drafted = scrape_metrics(cluster.decode[0].ready["metrics_address"])[DRAFTS]
        if drafted > drafted_before:
            break
        time.sleep(0.05)
    assert drafted > drafted_before


def test_a_decode_worker_given_a_draft_it_cannot_use_exits_2_before_loading(
        model_factory: Callable[..., Path], llama_dir: Path) -> None:
    for draft, why in ((llama_dir / "missing", "missing config.json"),
                       (model_factory("llama", vocab_size=1024), "vocabulary")):
        spec = json.dumps({"method": "draft_model", "model": str(draft),
                           "num_speculative_tokens": 2})
        result = subprocess.run(
            [sys.executable, "-m", "pdserve", "decode", "--model", str(llama_dir),
             "--redis-url", "redis://127.0.0.1:9", "--speculative-config", spec],
            capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 2, result.stderr
        assert why in result.stderr and "Traceback" not in result.stderr
