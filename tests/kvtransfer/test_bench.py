"""Smoke test of ``python -m bench.kvtransfer`` at a tiny setting: it runs end to end
(the received bytes are compared inside) and writes the JSON keys the issue asks for."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import kvtransfer as bench_kvtransfer

pytestmark = pytest.mark.timeout(180)


def test_bench_writes_required_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out" / "kv.json"
    bench_kvtransfer.main(["--sizes-mib", "1", "2", "--repeats", "1", "--part-mib", "1",
                           "--bandwidth-mib", "16", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["sizes_mib"] == [1, 2]
    for key in ("pdserve_gbps", "raw_gloo_gbps", "ratio"):
        assert len(data[key]) == 2 and all(math.isfinite(v) and v > 0 for v in data[key]), key
    for a, b, r in zip(data["pdserve_gbps"], data["raw_gloo_gbps"], data["ratio"], strict=True):
        assert r == pytest.approx(a / b)
    assert "ratio" in capsys.readouterr().out
