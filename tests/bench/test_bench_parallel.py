"""``python -m bench.parallel --quick``: n=1 and n=3 through a real cluster, their TTFT,
prompt tokens computed and KV bytes sent by the prefill worker reported (figures, never a
speed); the n=3 request's later choices prefill on choice 0's decode worker, from its
prefix cache."""

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
    # the other two choices prefill on choice 0's decode worker, from its prefix cache:
    # the prefill worker computes the prompt and sends its KV once
    assert three["prompt_tokens_computed"] == 64
    assert three["kv_bytes_sent"] == one["kv_bytes_sent"] > 0
