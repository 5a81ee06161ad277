"""An fp8 KV cache through real processes: Redis, a prefill worker (TP 1) and a decode
worker (TP 2: the KV is re-sharded in transit) both started with ``--kv-cache-dtype fp8``,
the router. Greedy and seeded streams through the SDK equal
``engine.LLM(kv_cache_dtype="fp8")`` token for token, and the KV the prefill worker sent is
exactly the fp8 cache's blocks: ``head_dim`` bytes per token, head and K/V, a quarter of
fp32's. (A worker whose KV dtype differs from the cluster's is refused at registration
naming ``kv_cache_dtype``: tests/worker/test_join.py.) The module's leak check ends each
test."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_model_config
from pdserve import Client
from tests.e2e.cluster import Cluster
from tests.e2e.test_kv_int8 import check_streams_and_bytes

pytestmark = pytest.mark.timeout(240)

FP8 = ("--kv-cache-dtype", "fp8")
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 2, "prefill_args": FP8,
           "decode_args": FP8}


def test_fp8_kv_streams_equal_the_fp8_kv_engine_and_move_a_quarter_of_fp32s_bytes(
        client: Client, cluster: Cluster, llama_dir: Path) -> None:
    head_dim = load_model_config(llama_dir).head_dim
    check_streams_and_bytes(client, cluster, llama_dir, "fp8", slot_bytes=head_dim)
