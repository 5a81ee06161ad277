"""``python -m bench.routing --quick``: the chat workload through a real cluster under one
routing arm, its figures reported (never asserted as speeds); the oracle on known prompts;
the decision's cost measured on the policy objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import routing

pytestmark = pytest.mark.timeout(300)


def test_the_oracle_counts_the_longest_shared_full_block_prefix() -> None:
    a = list(range(40))  # 2 full blocks + 8: nothing before it
    b = a[:32] + [99] * 20  # shares 2 blocks with a
    c = a[:16]  # shares its only block, capped at its length - 1
    d = [7] * 40  # shares nothing
    assert routing.oracle_cached_tokens([a, b, c, d]) == 0 + 32 + 15 + 0


def test_quick_reports_an_arm(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    assert routing.main(["--quick", "--chats", "3", "--turns", "2", "--system-tokens", "48",
                         "--user-tokens", "16", "--reply-tokens", "4", "--prefill", "2",
                         "--routers", "1", "--arms", "kv-aware,affinity-no-reuse",
                         "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    arm, whole = report["arms"]
    # without decode-side reuse every turn's whole prompt travels; with it, a chat's
    # second turn sends only what the decode worker lacks
    assert whole["arm"] == "affinity-no-reuse"
    assert whole["kv_bytes_per_request"] > arm["kv_bytes_per_request"]
    assert report["kv_bytes_fewer_than_no_reuse"] == {
        "1": {"kv-aware": whole["kv_bytes_per_request"] / arm["kv_bytes_per_request"]}}
    assert arm["arm"] == "kv-aware" and arm["requests"] == 6
    # every later turn starts with its chat's earlier turn and the reply: the oracle has
    # at least the system prompt's 3 blocks for all but the first prompt
    assert arm["oracle_tokens"] >= 5 * 48
    assert 0 < arm["cached_tokens"] <= arm["oracle_tokens"] + 6 * 4
    assert sum(arm["computed_per_worker"].values()) > 0 and arm["kv_bytes_per_request"] > 0
    # 4 tokens a reply: each turn's time between tokens is measured
    assert 0 < arm["tpot_p50_ms"] <= arm["tpot_p90_ms"] < arm["wall_s"] * 1e3
    assert report["decision"]["p99_ms"] > 0
    # the prompts kept on the decode worker, by reason: never without kv-aware routing
    assert set(arm["local_prefills"]) == set(routing.LOCAL_REASONS)
    assert sum(arm["local_prefills"].values()) <= 6
    assert sum(whole["local_prefills"].values()) == 0
    with pytest.raises(SystemExit, match="unknown arm"):
        routing.main(["--quick", "--arms", "kv-aware,nearest"])
