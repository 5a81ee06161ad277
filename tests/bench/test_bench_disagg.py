"""``python -m bench.disagg --quick``: both arms through real pinned processes on the tiny
model. Checks the JSON has every key the issue names with plausible values (positive,
percentiles ordered, attainment a share, the ratio consistent with the two maxima), that
the two configurations differ only in the split, and the plots; never a speed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import disagg

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")]

RATE_KEYS = ("request_rate", "slo_attainment", "num_requests", "completed", "failed",
             "request_throughput", "output_throughput", "total_token_throughput",
             "request_goodput", "ttft_attainment", "tpot_attainment",
             *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
               for s in ("mean", "median", "p90", "p99")))


def check_workload(result: dict[str, Any]) -> None:
    slo = result["slo"]
    assert slo["ttft_ms"] > 0 and slo["tpot_ms"] > 0
    for arm in disagg.ARMS:
        unloaded = slo["unloaded"][arm]
        assert unloaded["ttft_ms"] > 0 and unloaded["tpot_ms"] > 0
        assert slo["ttft_ms"] >= slo["ttft_factor"] * unloaded["ttft_ms"] - 1e-6
        rates = result[arm]["rates"]
        assert [r["request_rate"] for r in rates] == sorted(r["request_rate"] for r in rates)
        assert len(rates) == 2
        for entry in rates:
            missing = [k for k in RATE_KEYS if k not in entry]
            assert not missing, missing
            # nothing failed but what the benchmark cut off itself (a loaded machine can
            # make the quick run's tight SLO unreachable at its top rate)
            assert entry["failed"] == entry["cut_off"], entry
            assert entry["completed"] + entry["cut_off"] == entry["num_requests"]
            assert 0 <= entry["slo_attainment"] <= min(entry["ttft_attainment"],
                                                       entry["tpot_attainment"]) <= 1
            assert entry["request_rate"] > 0 and entry["request_throughput"] > 0
            for m in ("ttft", "tpot", "e2el"):
                assert 0 < entry[f"median_{m}_ms"] <= entry[f"p90_{m}_ms"] <= entry[f"p99_{m}_ms"]
        met = [r["request_rate"] for r in rates if r["slo_attainment"] >= 0.9]
        assert result[arm]["max_rate_at_slo"] == max(met, default=0.0)
    d, c = (result[a]["max_rate_at_slo"] for a in disagg.ARMS)
    assert result["goodput_ratio"] == (pytest.approx(d / c) if c > 0 else None)
    low, high = result["goodput_ratio_range"]
    if result["goodput_ratio"] is not None and low is not None and high is not None:
        assert low <= result["goodput_ratio"] <= high


def test_quick_compares_the_arms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "disagg.json"
    disagg.main(["--quick", "--json", str(out), "--plot", str(tmp_path / "plots")])
    data = json.loads(out.read_text())
    for key in ("slo", "disaggregated", "colocated", "goodput_ratio", "machine", "model",
                "configurations", "workloads"):
        assert key in data, key
    assert set(data["workloads"]) == {"long-prompt", "sharegpt-like"}
    assert data["slo"] == data["workloads"]["long-prompt"]["slo"]  # the headline workload
    for result in data["workloads"].values():
        check_workload(result)
    # the same rates, seeds and prompts in both arms
    for result in data["workloads"].values():
        assert [r["request_rate"] for r in result["disaggregated"]["rates"]] == \
            [r["request_rate"] for r in result["colocated"]["rates"]]
        for d_rate, c_rate in zip(result["disaggregated"]["rates"], result["colocated"]["rates"],
                                  strict=True):
            assert d_rate["num_requests"] == c_rate["num_requests"]
            if d_rate["cut_off"] == c_rate["cut_off"] == 0:  # totals count finished requests
                assert d_rate["total_input_tokens"] == c_rate["total_input_tokens"]
    # the configurations differ only in the split: two pinned single-thread workers each
    configs = data["configurations"]
    d, c = configs["disaggregated"], configs["colocated"]
    assert {k: v for k, v in d.items() if k not in ("processes", "local_prefill")} == \
        {k: v for k, v in c.items() if k not in ("processes", "local_prefill")}
    assert (d["local_prefill"], c["local_prefill"]) == ("never", "always")
    workers = {a: {n: p for n, p in configs[a]["processes"].items() if n != "router"}
               for a in disagg.ARMS}
    assert set(workers["disaggregated"]) == {"prefill-0", "decode-0"}
    assert set(workers["colocated"]) == {"decode-0", "decode-1"}
    for arm in disagg.ARMS:
        assert sorted(p["cpus"][0] for p in workers[arm].values()) == sorted(disagg.two_cpus())
        assert all(p["torch_threads"] == 1 for p in workers[arm].values())
    assert data["machine"]["cpu_model"] and data["machine"]["bandwidth_gbps_1_thread"] > 0
    assert data["model"]["parameters"] > 0
    for name in ("long-prompt_attainment.png", "long-prompt_cdf/ttft_cdf.png",
                 "sharegpt-like_cdf/tpot_cdf.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "goodput_ratio" in printed and "unpinned" in printed


def test_the_ratio_range_is_what_the_grid_allows() -> None:
    def out(d: list[float], c: list[float]) -> dict[str, Any]:
        def arm(attained: list[float]) -> dict[str, Any]:
            rates = [{"request_rate": r, "slo_attainment": a}
                     for r, a in zip([1.0, 2.0, 4.0], attained, strict=True)]
            met = [r["request_rate"] for r in rates if r["slo_attainment"] >= 0.9]
            return {"rates": rates, "max_rate_at_slo": max(met, default=0.0)}
        return {"disaggregated": arm(d), "colocated": arm(c)}

    # disaggregated limit in [2, 4), colocated in [1, 2): the ratio in (1, 4)
    assert disagg.ratio_range(out([1, 0.95, 0.5], [1, 0.5, 0])) == [1.0, 4.0]
    # colocated met it at no rate: in [0, 1), so the ratio is at least 2
    assert disagg.ratio_range(out([1, 1, 0.5], [0.5, 0, 0])) == [2.0, None]
    # disaggregated met it at the top: its limit is unbounded above
    assert disagg.ratio_range(out([1, 1, 1], [1, 0.5, 0])) == [2.0, None]
    assert disagg.ratio_range(out([1, 0.5, 0], [1, 1, 1])) == [0.0, 0.5]


def test_the_slo_is_the_factors_times_unloaded_unless_given() -> None:
    unloaded = {"ttft_ms": 100.0, "tpot_ms": 10.0}
    assert disagg.slo_ms(disagg.parse_args([]), unloaded) == {"ttft": 500.0, "tpot": 15.0}
    given = disagg.parse_args(["--tpot-slo-ms", "40"])
    assert disagg.slo_ms(given, unloaded) == {"ttft": 500.0, "tpot": 40.0}
