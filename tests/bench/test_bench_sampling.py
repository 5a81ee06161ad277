"""``python -m bench.sampling --quick``: every arm measured and compared with the plain one
(figures only: never a speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import sampling

pytestmark = pytest.mark.timeout(300)


def test_quick_measures_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "sampling.json"
    assert sampling.main(["--quick", "--batch", "4", "--prompt-len", "16", "--max-tokens", "8",
                          "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["tok_s"]) == set(sampling.ARMS)
    assert all(v > 0 for v in report["tok_s"].values())
    assert report["cost_vs_plain"]["plain"] == 0.0
