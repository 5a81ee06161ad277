"""``sim.roofline``: derived profiles are labelled derived and follow the arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import profile as bench_profile
from sim.profile import load
from sim.roofline import GPUS, MODELS, derive


def test_a_derived_profile_says_so_and_scales_with_tp() -> None:
    shape, gpu = MODELS["llama-3-8b"], GPUS["h100"]
    assert 7.9e9 < shape.parameters < 8.1e9  # Llama-3-8B has 8.03 B
    derived = derive(shape, gpu)
    assert derived.source == "derived" and "not measured" in derived.description
    steps = [derived.step(tp) for tp in (1, 2, 4, 8)]
    # batch-1 decode at TP 1: the weights over the bandwidth the roofline allows
    weights = shape.parameters * 2
    assert steps[0].base_s >= weights / gpu.hbm_bytes_per_s
    for a, b in zip(steps, steps[1:], strict=False):
        assert b.base_s < a.base_s and b.per_prefill_token_s == pytest.approx(
            a.per_prefill_token_s / 2)
        assert b.num_kv_blocks > 2 * a.num_kv_blocks  # twice the memory, one weight copy
    # the H200's bandwidth makes the weight read faster, its memory holds more KV
    h200 = derive(shape, GPUS["h200"]).step(1)
    assert h200.base_s < steps[0].base_s and h200.num_kv_blocks > steps[0].num_kv_blocks


def test_sizes_that_do_not_fit_are_left_out() -> None:
    derived = derive(MODELS["llama-3-70b"], GPUS["h100"])
    assert 1 not in derived.steps and 8 in derived.steps  # 141 GB of weights


def test_bench_profile_derive_writes_a_loadable_profile(tmp_path: Path) -> None:
    out = tmp_path / "h100.json"
    bench_profile.main(["--derive", "h100", "--shape", "llama-3-8b", "--tps", "1,8",
                        "--json", str(out)])
    assert load(out) == derive(MODELS["llama-3-8b"], GPUS["h100"], (1, 8))
    assert json.loads(out.read_text())["source"] == "derived"
