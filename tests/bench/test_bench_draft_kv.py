"""``bench.draft_kv``: one small run with the tiny model as target and draft (the trained
pair, its default, takes minutes to build: the benchmark's own run reports it): every
length has both ways' figures, composed as the module says."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import draft_kv

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                 reason="the KV transfer pins its two processes to two cores")]


def test_a_small_run_compares_recompute_and_ship_per_length(llama_dir: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "draft-kv.json"
    report = draft_kv.main(["--model", str(llama_dir), "--draft", str(llama_dir),
                            "--lengths", "40,100", "--output-len", "8", "--repeats", "1",
                            "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(report["rows"]))
    assert [r["prompt_len"] for r in rows] == [40, 100]
    for r in rows:
        assert r["ship_requests"] == 2  # the warm-up and the timed run: each guessed
        assert min(r["draft_prefill_ms"], r["draft_wire_ms"], r["plain_ttft_ms"],
                   r["recompute_last_ms"], r["ship_last_ms"]) > 0
    # a 40-token prompt catches up in its first decode step; 100 tokens need one more
    assert [r["catch_up_steps"] for r in rows] == [0, 1]


def test_shipping_adds_the_draft_prefill_and_the_wire_to_the_first_token() -> None:
    row = {"plain_1": 90.0, "plain_10": 160.0, "spec_1": 100.0, "spec_10": 150.0,
           "ship_10": 140.0, "draft_prefill_ms": 30.0}
    got = draft_kv.compare(130, row, draft_wire_ms=5.0, output_len=10)
    assert (got["plain_ttft_ms"], got["plain_last_ms"]) == (90.0, 160.0)
    assert (got["recompute_ttft_ms"], got["recompute_last_ms"]) == (100.0, 150.0)
    assert (got["ship_ttft_ms"], got["ship_last_ms"]) == (135.0, 145.0)
    assert got["catch_up_steps"] == 2  # 64, then 128 of 132 tokens; the third guesses
    assert [draft_kv.catch_up_steps(n) for n in (63, 64, 126, 127, 200, 1024)] == [0, 1, 1, 2, 3, 16]
