"""``python -m bench.profile --quick`` measures a loadable profile of the tiny model (step
times in-process; the handoff through a real cluster), and ``python -m bench.simulate``
runs ``bench.serve``'s workload on it, printing and writing ``bench.serve``'s keys."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bench import profile, simulate
from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from sim.profile import STEP_TERMS, StepModel, load
from tests.sim.profiles import profile_json

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``bench.profile --quick``'s profile of the tiny model (measured once)."""
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    return out, profile.main(["--quick", "--json", str(out)])


def test_quick_profile_is_measured_and_loads(measured: tuple[Path, dict[str, Any]]) -> None:
    out, written = measured
    loaded = load(out)
    assert loaded.source == "measured" and written["source"] == "measured"
    step = loaded.step(1)
    assert step.base_s > 0 and step.num_kv_blocks > 0
    assert loaded.model.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4  # tiny: 4 layers, 2x16, fp32
    assert loaded.handoff_overhead_s > 0 and loaded.router_overhead_s > 0
    points = written["points"]
    assert {p["kind"] for p in points["steps"]} == {"prefill", "decode"}
    # every batch at every context: none of a batch ends while its last prompt prefills
    assert {(p["context"], p["batch"]) for p in points["steps"] if p["kind"] == "decode"} \
        == {(c, b) for c in (0, 256) for b in (1, 8, 32)}
    assert len(points["handoff"]) >= 8
    # one torch thread: the handoff's two workers pinned to a core each, as the validation
    assert ("one core each" in written["description"]) == (len(os.sched_getaffinity(0)) >= 2)


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


def test_a_quick_validation_point_compares_with_a_real_cluster(
        measured: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out = tmp_path / "validation.json"
    report = simulate.main(["--validate", "--quick", "--profile", str(measured[0]),
                            "--num-prompts", "12", "--validate-rates", "4",
                            "--json", str(out)])
    assert json.loads(out.read_text()) == report
    (point,) = report["points"]
    assert point["layout"] == "disaggregated" and point["real"]["request_throughput"] > 0
    # a generous tolerance (the goal is 15%; this is one small point on a shared machine):
    # the simulator is within a factor of 3 of the real cluster
    for key in ("median_ttft_ms", "median_tpot_ms"):
        ratio = point["simulated"][key] / point["real"][key]
        assert 1 / 3 < ratio < 3, (key, point)
    # a lone request before the point, through the same cluster and the simulator
    lone = point["lone"]
    assert lone["real_ttft_ms"] > 0 and lone["simulated_ttft_ms"] > 0
    assert lone["ttft_error"] == pytest.approx(
        (lone["simulated_ttft_ms"] - lone["real_ttft_ms"]) / lone["real_ttft_ms"])
    assert lone["real_tpot_ms"] > 0 and lone["tpot_error"] is not None


def test_simulate_names_what_the_profile_lacks(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_json()))
    with pytest.raises(SystemExit, match=r"--decode-tp 8: .* no steps at TP 8; it has TP 1, 2"):
        simulate.main(["--profile", str(path), "--decode-tp", "8", "--num-prompts", "2"])
    with pytest.raises(SystemExit, match=r"--prefill-tp 4: .* no steps at TP 4"):  # the flag
        simulate.main(["--profile", str(path), "--prefill-tp", "4", "--num-prompts", "2"])
    with pytest.raises(SystemExit):  # argparse: nothing can prefill
        simulate.main(["--profile", str(path), "--prefill", "0", "--local-prefill", "never"])


def test_the_transfer_fit_counts_a_late_acknowledgement_once_and_ignores_a_few() -> None:
    """Per length: exposed 2 ms + 1 ms per 256 tokens; at 1024 tokens, two of five
    acknowledgements come 160 ms late while the stream already started (decode admission
    about -150 ms): the visible part is the two together, and a length's median wins."""
    samples = [{"prompt_len": n, "exposed_transfer": 2.0 + n / 256, "decode_admission": 3.0}
               for n in (256, 512, 1024) for _ in range(5)]
    samples[-2:] = [{"prompt_len": 1024, "exposed_transfer": 166.0, "decode_admission": -150.0}
                    for _ in range(2)]
    fit = profile.fit_transfer(samples, kv_bytes_per_token=1000)
    assert fit["latency_s"] == pytest.approx(0.002, abs=1e-6)
    assert fit["bytes_per_s"] == pytest.approx(256_000 / 0.001, rel=1e-6)  # 1 ms a 256 tokens


def test_the_clusters_prefill_is_the_fitted_steps_scaled_plus_a_cost_a_chunk() -> None:
    coef = {"base_s": 0.003, "multi_token_s": 0.0005, "prefill_step_s": 0.0015,
            "per_prefill_token_s": 1e-4, "per_prefill_attention_s": 0.0}
    # chunks of at most 512, each with 5 ms of fixed costs (base, more than one token, a
    # prefill); the cluster took 1.2x the per-token part and 8 ms more a chunk
    def took(n: int, chunks: int) -> dict[str, float]:
        return {"prompt_len": n, "prefill_compute": 1000 * (chunks * 0.013 + 1.2 * n * 1e-4)}

    samples = [took(64, 1), took(256, 1), took(1000, 2)] * 3
    scale, extra = profile.prefill_in_cluster(coef, samples)
    assert scale == pytest.approx(1.2) and extra == pytest.approx(0.008)
    # one length: the ratio alone
    assert profile.prefill_in_cluster(coef, [took(1000, 2)]) == (
        pytest.approx((0.026 + 0.12 - 0.010) / 0.1), 0.0)
    assert profile.prefill_in_cluster(coef, []) == (1.0, 0.0)
    assert profile.prefill_in_cluster(coef, [{"prompt_len": 64, "prefill_compute": 1.0}]) \
        == (0.5, 0.0)


def _step(decodes: Sequence[int], prefills: Sequence[tuple[int, int]]) -> SchedulerOutput:
    """A step of decode sequences at these contexts and prefill chunks of (tokens, start)."""
    return SchedulerOutput(
        decodes=[ScheduledChunk(f"d{i}", (1,), c, (), True) for i, c in enumerate(decodes)],
        prefills=[ScheduledChunk(f"p{i}", tuple(range(n)), start, (), True)
                  for i, (n, start) in enumerate(prefills)])


STEPS = [_step([10], []), _step([10, 500], []), _step([300] * 8, []), _step([], [(64, 0)]),
         _step([], [(512, 256)]), _step([40], [(128, 0)]), _step([], [(1, 0)]),
         _step([20] * 3, [(32, 64)]), _step([1000] * 4, []), _step([], [(256, 0)]),
         _step([700], []), _step([], [(32, 500)]), _step([5], [(300, 100)])]
TERMS = dict(zip(STEP_TERMS, (0.01, 0.002, 0.004, 3e-4, 2e-7, 1.2e-3, 1e-6), strict=True))


def test_the_fitted_quantities_are_the_step_models() -> None:
    step = StepModel(**TERMS, num_kv_blocks=1)
    for out in STEPS:
        features = profile.features(out)
        assert sum(f * TERMS[k] for f, k in zip(features, STEP_TERMS, strict=True)) \
            == pytest.approx(step.step_s(out))


def test_the_fit_finds_both_fixed_costs_and_leaves_one_it_cannot_tell_at_zero() -> None:
    step = StepModel(**TERMS, num_kv_blocks=1)
    points = [{"features": profile.features(out), "seconds": step.step_s(out)}
              for out in STEPS]
    coef, errors = profile.fit(points)
    assert coef == pytest.approx(TERMS) and max(map(abs, errors)) < 1e-9
    # no step of one token: "more than one token" is every step's, the base's
    batched = [p for p, out in zip(points, STEPS, strict=True)
               if len(out.decodes) + sum(len(c.token_ids) for c in out.prefills) > 1]
    coef, errors = profile.fit(batched)
    assert coef["multi_token_s"] == 0.0
    assert coef["base_s"] == pytest.approx(TERMS["base_s"] + TERMS["multi_token_s"])
    assert max(map(abs, errors)) < 1e-9
    # decode steps of one sequence only and prefills of many tokens (as --batches 1):
    # every step of more than one token prefills, so the prefill step's cost takes both
    single = [p for p, out in zip(points, STEPS, strict=True) if len(out.decodes) <= 1
              and all(len(c.token_ids) > 1 for c in out.prefills)]
    coef, errors = profile.fit(single)
    assert coef["multi_token_s"] == 0.0
    assert coef["prefill_step_s"] == pytest.approx(TERMS["prefill_step_s"]
                                                   + TERMS["multi_token_s"])


def test_the_loops_cost_per_stream_is_what_streams_at_once_add_beyond_the_fitted_step(
        ) -> None:
    coef = {"multi_token_s": 0.001, "per_decode_seq_s": 0.0005, "per_decode_context_s": 0.0}
    alone = [(80.0, 0.010)] * 3
    # each of the 3 other streams: 0.5 ms of the engine's and 2 ms of the loop's, plus
    # the engine's 1 ms for a step of several tokens
    together = [0.010 + 0.001 + 3 * (0.0005 + 0.002)] * 4
    assert profile.loop_per_stream(coef, alone, together) == pytest.approx(0.002)
    assert profile.loop_per_stream(coef, alone, [0.009] * 4) == 0.0  # never negative
    assert profile.loop_per_stream(coef, [], together) == 0.0
