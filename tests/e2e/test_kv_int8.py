"""An int8 KV cache through real processes: Redis, a prefill worker (TP 1) and a decode
worker (TP 2: the KV is re-sharded in transit, each block's scales with its values) both
started with ``--kv-cache-dtype int8``, the router. Greedy and seeded streams through the
SDK equal ``engine.LLM(kv_cache_dtype="int8")`` token for token, and the KV the prefill
worker sent is exactly the int8 cache's blocks: ``head_dim + 4`` bytes per token, head and
K/V, where fp32 takes ``4 head_dim``. (A worker whose KV dtype differs from the cluster's is refused at
registration naming ``kv_cache_dtype``: tests/worker/test_join.py.) The module's leak check
ends each test."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import load_model_config
from pdserve import Client
from tests.e2e.cluster import Cluster, scrape_metrics
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(240)

INT8 = ("--kv-cache-dtype", "int8")
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 2, "prefill_args": INT8,
           "decode_args": INT8}
PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)]
SENT = "pdserve:kv_transfer_bytes_total{direction=sent}"


def test_int8_kv_streams_equal_the_int8_kv_engine_and_move_its_bytes(
        client: Client, cluster: Cluster, llama_dir: Path) -> None:
    head_dim = load_model_config(llama_dir).head_dim
    check_streams_and_bytes(client, cluster, llama_dir, "int8", slot_bytes=head_dim + 4)


def check_streams_and_bytes(client: Client, cluster: Cluster, llama_dir: Path,
                            kv_cache_dtype: str, slot_bytes: int) -> None:
    """Greedy and seeded streams equal ``engine.LLM``'s with the same ``kv_cache_dtype``,
    and the prefill worker sent ``slot_bytes`` per token, KV head and K/V of every block."""
    # each round's prompts share no block with another's: every block is sent, whole
    rounds = [[f"Round {k}: {p} (a {kv_cache_dtype} KV cache)" for p in PROMPTS[:4]]
              for k in range(2)]
    # chunked as the workers chunk a prompt (a later chunk reads the earlier ones' K/V
    # from the quantised cache), one prompt at a time as the cluster computes them here (a
    # batch changes the last bits of K/V, which can move a value across a rounding step)
    with LLM(llama_dir, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=32) as llm:
        expected = [[llm.generate([prompt], p)[0].token_ids for prompt in prompts]
                    for prompts, p in zip(rounds, PARAMS, strict=True)]
        blocks = sum(-(-len(llm.encode(prompt)) // 16) for prompts in rounds for prompt in prompts)
    prefill = cluster.prefill[0].ready["metrics_address"]
    before = scrape_metrics(prefill).get(SENT, 0.0)
    got = [[list(client.complete(prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                                 seed=p.seed, ignore_eos=True).token_ids) for prompt in prompts]
           for prompts, p in zip(rounds, PARAMS, strict=True)]
    assert got == expected
    model = load_model_config(llama_dir)
    per_block = model.num_layers * 2 * 16 * model.num_kv_heads * slot_bytes
    assert scrape_metrics(prefill)[SENT] - before == blocks * per_block
