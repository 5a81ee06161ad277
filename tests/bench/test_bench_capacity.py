"""``bench.capacity`` and its search (``bench.fleet``): the layouts of N GPUs, the model's
estimate, the simulated goodput search, replication, and a quick run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import capacity
from bench.fleet import Layout, estimate, goodput, layouts
from sim.roofline import GPUS, MODELS, derive

PROFILE = derive(MODELS["llama-3-8b"], GPUS["h100"], (1, 2, 4))
CHAT = capacity.WORKLOADS["chat"]


def test_every_layout_uses_exactly_its_gpus_once() -> None:
    found = layouts(8, [1, 2, 4])
    assert len(found) == len(set(found)) and all(layout.gpus == 8 for layout in found)
    assert {str(layout) for layout in found if layout.colocated} == \
        {"8xTP1 colocated", "4xTP2 colocated", "2xTP4 colocated"}
    assert Layout(1, 2, 3, 2) in found and Layout(7, 1, 1, 1) in found
    assert all(layout.num_decode >= 1 for layout in found)
    assert str(Layout(3, 2, 1, 2)) == "3xTP2 P + 1xTP2 D"
    assert Layout(1, 2, 3, 2).scaled(4) == Layout(4, 2, 12, 2)


def test_the_model_gives_more_gpus_more_goodput() -> None:
    small = estimate(PROFILE, Layout(1, 1, 1, 1), CHAT, max_num_batched_tokens=8192)
    large = estimate(PROFILE, Layout(2, 1, 2, 1), CHAT, max_num_batched_tokens=8192)
    assert 0 < small < large <= 2.2 * small


def test_the_search_brackets_the_rate_where_attainment_falls_below_90_percent() -> None:
    lines: list[str] = []
    found = goodput(PROFILE, Layout(0, 1, 1, 1), CHAT, 200.0, duration_s=2.0,
                    max_prompts=400, probes=6, seed=0,
                    scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 2048},
                    progress=lines.append)
    probes = found["probes"]
    assert len(probes) == len(lines) <= 6 and found["bracketed"]
    met = [p["rate"] for p in probes if p["attainment"] >= 0.9]
    missed = [p["rate"] for p in probes if p["attainment"] < 0.9]
    assert met and missed and found["goodput"] == max(met) < min(missed)


def test_a_fleet_size_without_both_kinds_of_layout_is_skipped(capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    result = capacity.main(["--tps", "4", "--gpus", "4", "--simulate-up-to", "4",
                            "--workloads", "chat"])
    assert result["fleets"]["chat"] == {}  # 4 GPUs of TP 4: no disaggregated layout
    assert "chat: 4 GPUs skipped: no disaggregated and colocated layout" in capsys.readouterr().out


def test_a_quick_run_writes_simulated_and_replicated_fleets(tmp_path: Path) -> None:
    result = capacity.main(["--quick", "--json", str(tmp_path / "capacity.json")])
    written = json.loads((tmp_path / "capacity.json").read_text())
    assert written["profile"]["source"] == "derived"
    two, four = written["fleets"]["chat"]["2"], written["fleets"]["chat"]["4"]
    assert two["method"] == "simulated" and four["method"].startswith("replicated 2 x")
    assert two["best"]["layout"]["num_prefill"] >= 1 and \
        two["colocated"]["layout"]["num_prefill"] == 0
    assert four["best"]["goodput"] == pytest.approx(2 * two["best"]["goodput"])
    assert two["ratio"] == pytest.approx(two["best"]["goodput"] / two["colocated"]["goodput"])
    assert {c["label"] for c in two["candidates"]} >= {two["best"]["label"]}
    assert result["fleets"]["chat"][2]["best"]["goodput"] > 0


def test_the_day_is_its_segments_in_order_each_at_its_workloads_rate() -> None:
    from bench.diurnal import DAY, day_requests

    peaks = {"rag": 4.0, "chat": 40.0, "long-generation": 8.0}
    tagged = day_requests(capacity.WORKLOADS, peaks, 2.0, seed=1)
    by_segment = {i: [r for j, r in tagged if j == i] for i in range(len(DAY))}
    for i, (name, level) in enumerate(DAY):
        requests = by_segment[i]
        assert all(2.0 * i <= r.arrival_s < 2.0 * (i + 1) for r in requests)
        assert len(requests) == pytest.approx(peaks[name] * level * 2.0, rel=0.6, abs=3)
    rag = [r for i, r in tagged if DAY[i][0] == "rag"]
    chat = [r for i, r in tagged if DAY[i][0] == "chat"]
    assert min(r.prompt_len for r in rag) > max(r.prompt_len for r in chat) / 2
    again = day_requests(capacity.WORKLOADS, peaks, 2.0, seed=1)  # the same, new objects
    assert [(i, r.arrival_s, r.prompt_len) for i, r in again] == \
        [(i, r.arrival_s, r.prompt_len) for i, r in tagged]
    assert all(a is not b for (_, a), (_, b) in zip(again, tagged, strict=True))


def test_a_quick_day_runs_both_arms_on_the_same_requests(tmp_path: Path) -> None:
    from bench.diurnal import DAY

    capacity.main(["--quick", "--diurnal-only", "--json", str(tmp_path / "day.json")])
    day = json.loads((tmp_path / "day.json").read_text())["diurnal"]
    assert day["workers"] == 4 and day["start_split"]["num_prefill"] >= 1
    static, planner, scaling = (day["arms"][a] for a in ("static", "planner", "scaling"))
    assert static["role_changes"] == [] == static["scale_steps"] == planner["scale_steps"]
    assert scaling["worker_seconds"] <= 1.05 * static["worker_seconds"]  # never above 4
    assert day["planner"]["min_workers"] == 2 and day["planner"]["max_workers"] == 4
    sent = static["num_requests"]
    assert sent > 100 and planner["num_requests"] == scaling["num_requests"] == sent
    for arm in (static, planner, scaling):
        assert 0.0 <= arm["slo_attainment"] <= 1.0 and arm["failed"] >= 0
        assert len(arm["by_segment"]) == len(DAY)
        # overall attainment is the segments' weighted by their requests: in between
        segments = [v for v in arm["by_segment"] if v == v]
        assert min(segments) - 1e-9 <= arm["slo_attainment"] <= max(segments) + 1e-9
