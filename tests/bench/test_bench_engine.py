"""Smoke test of ``python -m bench.engine`` at a tiny setting: it runs end to end and
writes the JSON keys the issue asks for, with sane values."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from bench import engine as bench_engine  # noqa: E402

REQUIRED = ("pdserve_tok_s", "hf_generate_tok_s", "ratio_vs_hf", "batch1_step_ms",
            "roofline_step_ms", "roofline_fraction")


def _run(model_dir: Path, json_path: Path, *extra: str) -> dict:
    return bench_engine.main([
        "--model", str(model_dir), "--num-requests", "4", "--prompt-len", "8",
        "--output-len", "8", "--repeats", "1", "--batch1-steps", "6",
        "--bandwidth-mib", "16", "--bandwidth-passes", "2", "--json", str(json_path), *extra,
    ])


def test_bench_engine_writes_required_keys(model_factory: Callable[..., Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_LINEAR_KERNEL", raising=False)
    out_path = tmp_path / "out" / "bench.json"
    # one thread: two OpenMP threads crawl when the test machine's cores are busy
    returned = _run(model_factory("llama"), out_path, "--threads", "1")
    data = json.loads(out_path.read_text())
    for key in REQUIRED:
        assert isinstance(data[key], float) and math.isfinite(data[key]) and data[key] > 0, key
    assert data["ratio_vs_hf"] == pytest.approx(data["pdserve_tok_s"] / data["hf_generate_tok_s"])
    assert data["roofline_fraction"] == pytest.approx(
        data["roofline_step_ms"] / data["batch1_step_ms"])
    assert len(data["pdserve_runs_tok_s"]) == len(data["hf_runs_tok_s"]) == 1
    assert data["ratio_vs_hf_runs"] == pytest.approx([data["ratio_vs_hf"]])
    assert len(data["batch1_steps_ms"]) == 6
    assert data["threads"] == 1 and data["num_requests"] == 4
    assert isinstance(data["noise_warnings"], list)
    assert 0 < data["weight_bytes_per_step"] < data["weight_bytes"]
    assert data["bandwidth_gbps"] == max(data["bandwidth_samples_gbps"])
    # each of the 3 step blocks against the bandwidth sampled next to it (never above the
    # run's best, so each block's fraction is at least the strict one of its own steps)
    blocks = data["roofline_fraction_by_block"]
    assert len(blocks) == len(data["bandwidth_by_block_gbps"]) == 3
    assert all(0 < gbps <= data["bandwidth_gbps"] for gbps in data["bandwidth_by_block_gbps"])
    steps = data["batch1_steps_ms"]
    for fraction, gbps, block in zip(blocks, data["bandwidth_by_block_gbps"],
                                     (steps[:2], steps[2:4], steps[4:]), strict=True):
        assert fraction == pytest.approx(
            data["roofline_step_ms"] * data["bandwidth_gbps"] / gbps / statistics.median(block))
    assert returned["pdserve_tok_s"] == data["pdserve_tok_s"]
    # the CPU model and the kernels chosen at load (measured, or from the cache)
    assert data["cpu_model"] == data["machine"]["cpu_model"] and data["cpu_model"]
    assert data["linear_kernel_source"] in ("measured", "cache")
    kernels = {entry["kernel"] for entry in data["linear_kernel_plan"]}
    assert kernels <= {"torch", "onednn", "mm_t", "onednn_gemv", "packed"} and len(data["linear_kernel_plan"]) >= 5
    if len(kernels) == 1:
        assert data["linear_kernel"] == kernels.pop()
    else:
        assert data["linear_kernel"].startswith("mixed: ")
    assert data["kernel_choice_s"] >= 0
    assert data["attention_backend"] in ("cpu", "torch")
    assert (data["attention_backend"] == "cpu") == (data["cpu_kernels_library"] is not None)
    printed = capsys.readouterr().out
    assert "ratio_vs_hf" in printed and "roofline_fraction" in printed
    assert f"kernels   {data['linear_kernel']} ({data['linear_kernel_source']}" in printed
    assert data["cpu_model"] in printed


def test_bench_engine_skip_hf(model_factory: Callable[..., Path], tmp_path: Path) -> None:
    import torch

    threads_before = torch.get_num_threads()
    out_path = tmp_path / "bench.json"
    _run(model_factory("llama"), out_path, "--skip-hf")  # default: 2 threads
    data = json.loads(out_path.read_text())
    assert data["threads"] == 2
    assert torch.get_num_threads() == threads_before  # the benchmark restores the count
    assert data["hf_generate_tok_s"] is None and data["ratio_vs_hf"] is None
    assert data["pdserve_tok_s"] > 0 and data["roofline_fraction"] > 0


def test_bench_engine_forced_kernel(model_factory: Callable[..., Path], tmp_path: Path) -> None:
    out_path = tmp_path / "bench.json"
    _run(model_factory("llama"), out_path, "--skip-hf", "--threads", "1", "--linear-kernel", "mm_t")
    data = json.loads(out_path.read_text())
    assert (data["linear_kernel"], data["linear_kernel_source"]) == ("mm_t", "config")


def test_bench_engine_rejects_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        bench_engine.main(["--num-requests", "0"])


def test_noise_warnings_flag_spread_and_load() -> None:
    quiet = {"pdserve_runs_tok_s": [800.0, 820.0], "hf_runs_tok_s": [700.0, 690.0],
             "machine": {"load_avg_1m_5m_15m": [0.3, 0.5, 0.5]}}
    assert bench_engine.noise_warnings(quiet) == []
    busy = {"pdserve_runs_tok_s": [800.0], "hf_runs_tok_s": [24.5, 727.0],
            "machine": {"load_avg_1m_5m_15m": [3.5, 2.0, 1.0]}}
    found = bench_engine.noise_warnings(busy)
    assert any("hf_runs_tok_s" in w for w in found) and any("load" in w for w in found)


def test_common_helpers() -> None:
    import numpy as np

    from bench import common

    values = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    for q in (0, 50, 90, 99, 100):
        assert common.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    stats = common.summarize(values, "ttft", "ms")
    assert set(stats) == {"mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"}
    table = common.format_table([["a", 1.5], ["long name", 1234.5]], ["name", "value"])
    lines = table.splitlines()
    assert lines[0].startswith("name") and lines[-1].endswith("1,234.5")
    assert len({len(line) for line in lines}) == 1  # columns aligned
    probe = common.BandwidthProbe(4 << 20, threads=1)
    assert probe.measure(passes=2) > 0 and probe.best_gbps == probe.samples_gbps[0]
