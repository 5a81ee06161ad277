"""``python -m bench.handoff --quick``: the TTFT breakdown, router overhead and prefix
affinity through real processes on the tiny model. Checks the JSON has every key the issue
names, per prompt length too, with plausible values (non-negative parts that add up to
the TTFT, positive timings, p50 <= p99, fractions within [0, oracle]); never a speed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import handoff

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")]

KEYS = ("ttft_breakdown_ms", "orchestration_p50_ms", "exposed_transfer_p50_ms",
        "one_layer_transfer_ms", "router_overhead_p50_ms", "router_overhead_p99_ms")
ISSUE_PARTS = ("router_queue", "prefill_queue", "prefill_compute", "exposed_transfer",
               "decode_admission", "delivery")


def check_length(entry: dict[str, Any]) -> None:
    missing = [k for k in KEYS if k not in entry]
    assert not missing, missing
    parts = entry["ttft_breakdown_ms"]
    assert set(ISSUE_PARTS) <= set(parts) == set(handoff.PARTS)
    assert all(parts[p] >= -0.5 for p in parts), parts  # rounding of the marks only
    assert parts["prefill_compute"] > 0 and parts["decode_admission"] > 0
    assert entry["ttft_p50_ms"] > parts["prefill_compute"]
    assert entry["exposed_transfer_p50_ms"] == parts["exposed_transfer"]
    assert 0 < entry["orchestration_p50_ms"] < entry["ttft_p50_ms"]
    assert entry["one_layer_transfer_ms"] > 0
    for sub in ("to_first_worker_call", "to_first_worker_call_unqueued", "token_to_client"):
        assert 0 < entry["router_overhead_p50_ms"][sub] <= entry["router_overhead_p99_ms"][sub]
    assert entry["router_overhead_p99_ms"]["to_first_worker_call_unqueued"] <= \
        entry["router_overhead_p99_ms"]["to_first_worker_call"] + 1e-6
    assert entry["overhead_requests"] >= 10 and entry["overhead_achieved_rate"] > 0


def test_quick_reports_every_key(tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    handoff.main(["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data["by_prompt_len"]) == {"64", "256"} and data["prompt_len"] == 256
    for entry in data["by_prompt_len"].values():
        check_length(entry)
    check_length(data)
    assert {k: data[k] for k in KEYS} == {k: data["by_prompt_len"]["256"][k] for k in KEYS}
    affinity = data["prefix_affinity"]
    oracle = affinity["oracle_cached_fraction"]
    assert 0 < oracle < 1
    for routing in ("affinity", "round_robin"):
        found = affinity[routing]
        assert 0 <= found["cached_fraction"] <= oracle + 1e-9
        assert 0 < found["median_ttft_ms"] <= found["p90_ttft_ms"] <= found["p99_ttft_ms"]
    # 3 prefixes, each first used in turn, sent one at a time: affinity caches every repeat
    # (the oracle); round robin cannot until a prefix has been on both workers
    assert affinity["affinity"]["cached_fraction"] == pytest.approx(oracle)
    assert affinity["round_robin"]["cached_fraction"] < oracle
    assert data["machine"]["cpu_model"] and data["model"]["parameters"] > 0


def test_the_parts_add_up_to_the_ttft() -> None:
    result = {"ttft_ms": 50.0, "trace": {
        "marks_ms": {"first_call": 1.0, "generate_started": 1.9, "prefill_started": 2.0,
                     "first_chunk": 45.0, "prefill_returned": 45.2, "first_sent": 45.5},
        "prefill_ms": {"queue": 1.0, "compute": 30.0, "transfer": 5.0}}}
    parts = handoff.breakdown(result)
    assert set(parts) == set(handoff.PARTS)
    assert sum(parts.values()) == pytest.approx(50.0)
    assert parts["reserve"] == pytest.approx(1.0) and parts["delivery"] == 4.5
    # the first chunk 43 ms after the Prefill was sent, 36 of them on the prefill worker
    assert parts["decode_admission"] == pytest.approx(7.0) and parts["router_relay"] == 0.5


def test_the_breakdown_alone_over_an_int8_kv_cache(tmp_path: Path) -> None:
    """``--kv-cache-dtype int8 --breakdown-only``: the breakdown's workers hold int8 KV (a
    layer's transfer then moves ``head_dim + 4`` bytes per token and head, not ``4 head_dim``);
    no router-overhead or affinity run."""
    out = tmp_path / "handoff.json"
    handoff.main(["--quick", "--kv-cache-dtype", "int8", "--breakdown-only", "--prompt-lens",
                  "64", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["kv_cache_dtype"] == "int8" and data["prefix_affinity"] == {}
    entry = data["by_prompt_len"]["64"]
    assert entry["ttft_breakdown_ms"]["exposed_transfer"] >= -0.5
    assert entry["one_layer_transfer_ms"] > 0 and "router_overhead_p50_ms" not in entry
