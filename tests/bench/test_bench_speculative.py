"""``bench.speculative``: one small run on a tiny model given with ``--model`` (the trained
preset, its default, takes minutes to build: the benchmark's own run reports it): every
workload at both batch sizes, outputs checked equal, the figures consistent."""

from __future__ import annotations

import json
from pathlib import Path

from bench import speculative


def test_a_small_run_reports_each_workload_and_batch(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    report = speculative.main(["--model", str(llama_dir), "--batch", "2", "--passage-len",
                               "40", "--repeat-len", "24", "--output-len", "24",
                               "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(report["rows"]))
    assert [(r["workload"], r["batch"]) for r in rows] == [
        ("input-grounded", 1), ("free-text", 1), ("input-grounded", 2), ("free-text", 2)]
    for r in rows:
        assert 0 <= r["kept"] <= r["drafted"] and 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0
        assert abs(r["speedup"] - r["spec_tok_s"] / r["plain_tok_s"]) < 1e-9


def test_bench_engine_speculative_runs_it_with_its_flags(llama_dir: Path, tmp_path: Path) -> None:
    from bench import engine as bench_engine

    config = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    out = tmp_path / "engine-spec.json"
    report = bench_engine.main(["--speculative", json.dumps(config), "--model", str(llama_dir),
                                "--batch", "2", "--passage-len", "40", "--repeat-len", "24",
                                "--output-len", "16", "--repeats", "1", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["speculative_config"] == config
    assert [(r["workload"], r["batch"]) for r in report["rows"]] == [
        ("input-grounded", 1), ("free-text", 1), ("input-grounded", 2), ("free-text", 2)]


def test_a_draft_model_run_names_its_draft_and_keeps_the_outputs(llama_dir: Path) -> None:
    """``--method draft_model --draft DIR``: the target as its own draft (in int8) keeps
    some guesses (the outputs are checked equal inside the run)."""
    report = speculative.main(["--model", str(llama_dir), "--method", "draft_model",
                               "--draft", str(llama_dir), "--batch", "2", "--passage-len",
                               "40", "--repeat-len", "24", "--output-len", "24",
                               "--repeats", "1"])
    assert report["speculative_config"] == {"method": "draft_model", "model": str(llama_dir),
                                            "num_speculative_tokens": 4, "quantization": "int8"}
    assert all(r["drafted"] > 0 and r["kept"] > 0 for r in report["rows"])
