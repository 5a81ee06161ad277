"""``python -m bench.migration --quick``: a decode worker SIGKILLed, then one drained (its
stream's KV moves), under one stream: the stream whole (the bench checks it against the
unfaulted output and fails otherwise), its stall and the unloaded TTFT reported per
fault; never a speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import migration

pytestmark = pytest.mark.timeout(300)


def test_quick_reports_the_stall_against_the_ttft(tmp_path: Path) -> None:
    out = tmp_path / "migration.json"
    # 192 tokens: the stream must still be on its decode worker when this client has read
    # 8 of them, however busy the cores are
    assert migration.main(["--quick", "--trials", "1", "--lengths", "48", "--max-tokens",
                           "192", "--kill-after", "8", "--settle-s", "0",
                           "--faults", "kill", "move", "--json", str(out)]) == 0
    by_fault = json.loads(out.read_text())["by_fault"]
    assert set(by_fault) == {"kill", "move"}
    for entry in (by_fault["kill"]["48"], by_fault["move"]["48"]):
        _check(entry)


def _check(entry: dict[str, float]) -> None:
    assert entry["ttft_p50_ms"] > 0 and entry["stall_p50_ms"] > 0
    assert entry["stall_over_ttft"] == pytest.approx(entry["stall_p50_ms"]
                                                     / entry["ttft_p50_ms"])
    assert entry["goal_met"] == (entry["stall_p50_ms"] <= 2 * entry["ttft_p50_ms"])
