"""``python -m bench.parallel --quick``: n=1 and n=3 through a real cluster, their TTFT,
prompt tokens computed and KV bytes sent by the prefill worker reported (figures, never a
speed); the n=3 request's later choices hit the prefill worker's prefix cache and that
of choice 0's decode worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import parallel

pytestmark = pytest.mark.timeout(300)


def test_quick_reports_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "parallel.json"
    assert parallel.main(["--quick", "--n", "3", "--prompt-len", "64", "--max-tokens", "4",
                          "--trials", "1", "--json", str(out)]) == 0
    medians = json.loads(out.read_text())["medians"]
    one, three = medians["1"], medians["3"]
    assert one["ttft_s"] > 0 and three["ttft_s"] > 0
    assert one["prompt_tokens_computed"] == 64  # a fresh prompt, computed once
    # the other two choices compute at most their last partial block (16-token blocks)
    assert 64 <= three["prompt_tokens_computed"] <= 64 + 2 * 16
    # ... and receive only that block: 4 + 1 + 1 blocks against n=1's 4
    assert three["kv_bytes_sent"] * 4 == one["kv_bytes_sent"] * 6
