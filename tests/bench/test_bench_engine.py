"""Smoke test of ``python -m bench.engine`` at a tiny setting: it runs end to end and
writes the JSON keys the issue asks for, with sane values."""

from __future__ import annotations

import json
import math
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
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    threads_before = torch.get_num_threads()
    out_path = tmp_path / "out" / "bench.json"
    returned = _run(model_factory("llama"), out_path)
    data = json.loads(out_path.read_text())
    for key in REQUIRED:
        assert isinstance(data[key], float) and math.isfinite(data[key]) and data[key] > 0, key
    assert data["ratio_vs_hf"] == pytest.approx(data["pdserve_tok_s"] / data["hf_generate_tok_s"])
    assert data["roofline_fraction"] == pytest.approx(
        data["roofline_step_ms"] / data["batch1_step_ms"])
    assert len(data["pdserve_runs_tok_s"]) == len(data["hf_runs_tok_s"]) == 1
    assert len(data["batch1_steps_ms"]) == 6
    assert data["threads"] == 2 and data["num_requests"] == 4
    assert 0 < data["weight_bytes_per_step"] < data["weight_bytes"]
    assert data["bandwidth_gbps"] == max(data["bandwidth_samples_gbps"])
    assert returned["pdserve_tok_s"] == data["pdserve_tok_s"]
    assert torch.get_num_threads() == threads_before  # the benchmark restores the count
    printed = capsys.readouterr().out
    assert "ratio_vs_hf" in printed and "roofline_fraction" in printed


def test_bench_engine_skip_hf(model_factory: Callable[..., Path], tmp_path: Path) -> None:
    out_path = tmp_path / "bench.json"
    _run(model_factory("llama"), out_path, "--skip-hf", "--threads", "1")
    data = json.loads(out_path.read_text())
    assert data["hf_generate_tok_s"] is None and data["ratio_vs_hf"] is None
    assert data["pdserve_tok_s"] > 0 and data["roofline_fraction"] > 0


def test_bench_engine_rejects_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        bench_engine.main(["--num-requests", "0"])
