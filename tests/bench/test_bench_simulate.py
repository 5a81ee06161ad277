"""``python -m bench.profile --quick`` measures a loadable profile of the tiny model (step
times in-process; the handoff through a real cluster), and ``python -m bench.simulate``
runs ``bench.serve``'s workload on it, printing and writing ``bench.serve``'s keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import profile, simulate
from sim.profile import load
from tests.sim.profiles import profile_json

pytestmark = pytest.mark.timeout(300)


def test_quick_profile_is_measured_and_loads(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    written = profile.main(["--quick", "--json", str(out)])
    loaded = load(out)
    assert loaded.source == "measured" and written["source"] == "measured"
    step = loaded.step(1)
    assert step.base_s > 0 and step.num_kv_blocks > 0
    assert loaded.model.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4  # tiny: 4 layers, 2x16, fp32
    assert loaded.handoff_overhead_s > 0 and loaded.router_overhead_s > 0
    points = written["points"]
    assert {p["kind"] for p in points["steps"]} == {"prefill", "decode"}
    assert len(points["handoff"]) >= 8


def test_simulate_writes_bench_serve_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json()))
    out = tmp_path / "sim.json"
    args = ["--profile", str(path), "--prefill", "2", "--decode", "2",
            "--dataset-name", "sharegpt-like", "--num-prompts", "200", "--request-rate", "20",
            "--goodput", "ttft:500", "tpot:50", "--json", str(out)]
    result = simulate.main(args)
    printed = capsys.readouterr().out
    assert "Simulated Serving Result (derived profile)" in printed
    assert "Median TTFT (ms):" in printed
    saved = json.loads(out.read_text())
    for key in ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "request_throughput", "request_goodput", "slo_attainment"):
        assert saved[key] == result[key] and saved[key] > 0, key
    assert saved["completed"] == 200 and saved["failed"] == 0
    assert simulate.main(args)["median_ttft_ms"] == result["median_ttft_ms"]  # same seed


def test_simulate_names_what_the_profile_lacks(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json()))
    with pytest.raises(SystemExit, match=r"no steps at TP 8 \(it has TP 1, 2\)"):
        simulate.main(["--profile", str(path), "--decode-tp", "8", "--num-prompts", "2"])
    with pytest.raises(SystemExit):  # argparse: nothing can prefill
        simulate.main(["--profile", str(path), "--prefill", "0", "--local-prefill", "never"])
