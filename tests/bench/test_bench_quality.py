"""``bench.quality``: its comparison (agreement and KL against hand-computed cases) and
one run on a tiny model given with ``--model`` (the trained preset, its default, takes
minutes to build: the benchmark's own run reports it)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from bench import quality


def test_compare_counts_agreement_and_kl() -> None:
    reference = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    assert quality.compare(reference, reference) == {"top1_agreement": 1.0, "mean_kl": 0.0,
                                                     "max_kl": 0.0, "positions": 2}
    other = torch.tensor([[[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])  # the second top-1 moved
    got = quality.compare(reference, other)
    p = torch.softmax(reference[0, 1].double(), -1)
    q = torch.softmax(other[0, 1].double(), -1)
    kl = float((p * (p / q).log()).sum())
    assert got["top1_agreement"] == 0.5 and math.isclose(got["max_kl"], kl)
    assert math.isclose(got["mean_kl"], kl / 2)


def test_a_run_on_a_given_model_reports_int8_against_fp32(llama_dir: Path, tmp_path: Path,
                                                         capsys: object) -> None:
    out = tmp_path / "quality.json"
    assert quality.main(["--model", str(llama_dir), "--windows", "2", "--window-tokens", "64",
                         "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["positions"] == 128 and result["quantization"] == "int8"
    assert 0.5 < result["top1_agreement"] <= 1.0 and 0 < result["mean_kl"] <= result["max_kl"]


def test_an_int8_kv_cache_is_measured_a_token_at_a_time(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    assert quality.main(["--model", str(llama_dir), "--kv-cache-dtype", "int8", "--windows", "1",
                         "--window-tokens", "48", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "int8" and result["quantization"] is None
    assert result["positions"] == 48 and result["what"] == "int8 KV cache"
    assert 0.5 < result["top1_agreement"] <= 1.0 and 0 < result["mean_kl"] <= result["max_kl"]


def test_kv_quantised_for_the_wire_is_measured_on_what_is_decoded_after_it(
        llama_dir: Path, tmp_path: Path) -> None:
    """The second half of each window, decoded from the first half's KV as the wire's
    quantiser leaves it, against the same handoff in fp32: lossy, so the KL is positive."""
    out = tmp_path / "quality.json"
    assert quality.main(["--model", str(llama_dir), "--kv-transfer-dtype", "int8", "--windows",
                         "1", "--window-tokens", "48", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_transfer_dtype"] == "int8" and result["quantization"] is None
    assert result["positions"] == 24 and result["what"] == "int8 KV transfer"
    assert 0.5 < result["top1_agreement"] <= 1.0 and 0 < result["mean_kl"] <= result["max_kl"]
