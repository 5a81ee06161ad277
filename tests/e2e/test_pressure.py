"""KV pressure on the decode worker (RELIABILITY row 11), through real processes: a
decode worker whose KV pool cannot hold every admitted request's output at once must
preempt (local recompute) rather than fail or deadlock, and every request still gets
exactly the tokens ``engine.LLM`` produces. Ends with the leak check on every worker."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve.client import Client
from tests.e2e.cluster import Cluster
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(300)

DECODE_KV_BLOCKS = 24  # 384 tokens: far less than the requests below need together
NUM_REQUESTS = 6
MAX_TOKENS = 100  # each request grows to ~8 blocks; 6 of them need ~48


CLUSTER = {
    "num_prefill": 1,
    "num_decode": 1,
    "decode_tp": 1,
    "decode_kv_blocks": DECODE_KV_BLOCKS,
    "decode_args": ("--grace", "20"),
}


def test_decode_kv_pressure_preempts_and_every_request_is_right(cluster: Cluster,
                                                                llama_dir: Path) -> None:
    texts = [f"{PROMPTS[i]} {PROMPTS[(i + 3) % len(PROMPTS)]}" for i in range(NUM_REQUESTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with LLM(llama_dir) as llm:
        expected = [r.token_ids for r in llm.generate(texts, params)]
    with Client(cluster.address) as client, ThreadPoolExecutor(NUM_REQUESTS) as pool:
        results = list(pool.map(
            lambda text: client.complete(text, max_tokens=MAX_TOKENS, temperature=0,
                                         ignore_eos=True, timeout=240.0), texts))
    assert [list(r.token_ids) for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    # the pool really was too small: the decode worker preempted at least once
    assert cluster.info(cluster.decode[0]).num_preemptions >= 1
    cluster.assert_no_leaks()


def test_a_draining_decode_worker_finishes_its_streams(cluster: Cluster) -> None:
    # SIGTERM: the worker turns NOT_SERVING and finishes what it streams within its
    # grace period; the router must not cut those streams (last test: it stops decode-0)
    import signal

    with Client(cluster.address) as client:
        # ~300 tokens outlast several of the router's health checks (every 0.5 s)
        stream = client.generate("drain " * 4, max_tokens=300, ignore_eos=True,
                                 timeout=120.0)
        received = list(next(stream).token_ids)
        cluster.decode[0].proc.send_signal(signal.SIGTERM)
        for chunk in stream:
            received += chunk.token_ids
            last = chunk
    assert len(received) == 300 and last.finish_reason == "length"
    assert cluster.decode[0].proc.wait(60) == 0
