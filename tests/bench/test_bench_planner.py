"""``bench.planner``: the pieces of its report without a cluster (the planner's role
changes read from its log, attainment over time, the verdict, the dwell check), and
(marked ``slow``: about two minutes) ``--quick`` end to end through real pinned
processes: every key the issue names, plausible values, the planner's changes with
reasons; never a speed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from bench import planner as bench
from sim.metrics import Outcome

LOG = """2026-12-03 13:14:58,113 INFO role=planner planner.service request_id=- planner a: SLO
2026-12-03 13:15:20,600 INFO role=planner rank=0 pid=1 planner.service request_id=- switched \
decode-0: decode -> prefill: 3.10 req/s of 512+64 tokens: predicted attainment 0.20 at 0P+2D
2026-12-03 13:15:30,000 INFO role=planner rank=0 pid=1 planner.service request_id=- switched \
decode-0: prefill -> decode: 2.00 req/s"""


def test_role_changes_are_read_from_the_planner_log_in_seconds_from_the_start() -> None:
    from datetime import datetime

    start = datetime(2026, 12, 3, 13, 15, 0).timestamp()
    changes = bench.role_changes(LOG, start)
    assert [(c["t"], c["worker"], c["from"], c["to"]) for c in changes] == [
        (20.6, "decode-0", "decode", "prefill"), (30.0, "decode-0", "prefill", "decode")]
    assert changes[0]["reason"].startswith("3.10 req/s of 512+64 tokens")
    assert bench.undone_within(changes, 20.0) == ["decode-0 at 20.6s and 30.0s"]
    assert bench.undone_within(changes, 5.0) == []


def _outcome(sent_at: float, ok: bool) -> Outcome:
    return Outcome(prompt_len=8, max_tokens=2, sent_at=sent_at, success=True, output_len=2,
                   ttft=0.01 if ok else 9.0, latency=0.02 if ok else 9.5)


def test_attainment_over_time_and_the_verdict() -> None:
    slo = {"ttft": 100.0, "tpot": 50.0}
    outcomes = [_outcome(1, True), _outcome(2, False), _outcome(12, True)]
    assert bench.over_time(outcomes, slo) == [(0.0, 0.5), (10.0, 1.0)]

    def arm(overall: float, by_phase: list[float], failed: int = 0) -> dict[str, Any]:
        return {"slo_attainment": {"overall": overall, "by_phase": by_phase}, "failed": failed,
                "role_changes": []}

    run = {"arms": {"disaggregated": arm(0.6, [0.9, 0.3, 0.9]),
                    "colocated": arm(0.5, [0.4, 0.8, 0.4]),
                    "planner": arm(0.75, [0.9, 0.7, 0.8])}}
    v = bench.verdict(run, 20.0)
    assert v["goal_met"] and v["planner_minus_best_static"] == pytest.approx(0.15)
    assert v["static_arms_apart_by_phase"] == pytest.approx([0.5, 0.5, 0.5])
    run["arms"]["planner"]["failed"] = 1  # a failed request fails the goal
    assert not bench.verdict(run, 20.0)["goal_met"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_quick_runs_every_arm(tmp_path: Path) -> None:
    result = bench.main(["--quick", "--json", str(tmp_path / "out.json"),
                         "--plot", str(tmp_path / "plots")])
    saved = json.loads((tmp_path / "out.json").read_text())
    assert set(saved["arms"]) == set(bench.ARMS)
    for name in bench.ARMS:
        arm = saved["arms"][name]
        assert 0 <= arm["slo_attainment"]["overall"] <= 1
        assert len(arm["slo_attainment"]["by_phase"]) == len(bench.PHASES)
        assert arm["failed"] == 0 and arm["requests"] > 0
    assert saved["plan"]["slo_ms"]["ttft"] > 0 and saved["plan"]["rates"]["long-prompt"] > 0
    for change in saved["arms"]["planner"]["role_changes"]:
        assert change["to"] in ("prefill", "decode") and "req/s" in change["reason"]
    assert result["verdict"].keys() >= {"goal_met", "planner_minus_best_static"}
    assert (tmp_path / "plots" / "planner-attainment.png").is_file()


def test_the_streams_within_the_slo_are_read_between_the_points_that_bracket_it() -> None:
    """The line through the closest points either side of the SLO; past the points, no
    further than twice the most streams measured; a flat or falling line gives the side
    of the SLO the points are on."""
    assert bench.streams_at([(1, 10.0), (8, 24.0)], 17.0) == pytest.approx(4.5)
    # the pair nearest the SLO either side, not the outer points
    assert bench.streams_at([(1, 10.0), (4, 14.0), (6, 18.0), (8, 30.0)], 16.0) == \
        pytest.approx(5.0)
    # all below: extrapolated along the nearest two, capped at twice the most measured
    assert bench.streams_at([(1, 10.0), (8, 12.0)], 13.0) == pytest.approx(11.5)
    assert bench.streams_at([(1, 10.0), (8, 11.0)], 30.0) == 16
    assert bench.streams_at([(1, 10.0), (8, 30.0)], 5.0) == 1.0  # never below one
    assert bench.streams_at([(1, 10.0), (8, 9.0)], 20.0) == 16  # noise: flat, all below
    assert bench.streams_at([(1, 30.0), (8, 20.0)], 15.0) == 1.0  # flat, all above
    # noise: a point past the SLO between points within it; the line runs from the most
    # streams within it to the fewest past it with more, else stops at the most within it
    assert bench.streams_at([(1, 10.0), (6, 17.0), (8, 15.0), (12, 20.0)], 16.0) == \
        pytest.approx(8.8)
    assert bench.streams_at([(1, 10.0), (8, 14.5), (12, 15.5), (16, 14.9)], 15.0) == 16


def test_a_probe_reads_the_requests_that_ran_at_full_load_and_counts_failures_past_the_slo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the requests that ended before the last one was sent ran with every stream
    busy; of those, one that failed counts as past the SLO (not as absent)."""
    def outcome(sent: float, latency: float, tpot_ms: float | None, ttft: float = 0.1
                ) -> Outcome:
        o = Outcome(prompt_len=8, max_tokens=11, sent_at=sent, success=tpot_ms is not None,
                    output_len=11, ttft=ttft, latency=latency)
        if tpot_ms is not None:
            o.latency = ttft + 10 * tpot_ms / 1000
        return o

    ran = [outcome(0.0, 0, 10.0), outcome(0.0, 0, 12.0), outcome(0.11, 0.05, None),
           outcome(0.2, 0, 30.0, ttft=0.3),  # sent before the last, ended after it
           outcome(0.3, 0, 2.0), outcome(0.4, 0, 2.0)]  # the ramp-down: fewer in flight
    monkeypatch.setattr(bench, "send", lambda *a, **k: (ran, 1.0))
    got = bench.probe("unused", 4160, True, 2, seed=0)
    # ended by 0.4 s: 10 ms, 12 ms and the failure (infinite): median 12 ms
    assert got.tpot_ms == pytest.approx(12.0)
    assert got.ttft_ms == pytest.approx(100.0)  # the two that succeeded among them
    assert got.req_s == pytest.approx(5.0)  # every request that succeeded, over the run


def test_the_decode_heavy_rate_is_what_the_streams_within_the_slo_finish_a_second() -> None:
    """Little's law: the streams over a request's mean latency at the SLO's TPOT (the
    nearest probe's TTFT, then the mix's mean output less one token)."""
    from argparse import Namespace

    from loadtest.workloads import Workload

    probes = [bench.Probe(4, 12.0, ttft_ms=100.0, req_s=1.0),
              bench.Probe(8, 20.0, ttft_ms=300.0, req_s=1.0)]
    sample = Workload(bench.workload_spec("sharegpt-like", True), 4160, seed=7).take(200)
    output = sum(r.max_tokens for r in sample) / len(sample)
    got = bench.decode_capacity(Namespace(quick=True), 4160, 5.0, probes, 16.0)
    assert got == pytest.approx(1000 * 5.0 / (100.0 + (output - 1) * 16.0))
    assert bench.decode_capacity(Namespace(quick=True), 4160, 7.0, probes, 16.0) == \
        pytest.approx(1000 * 7.0 / (300.0 + (output - 1) * 16.0))
