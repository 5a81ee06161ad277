"""GPU paths (CUDA SDPA over gathered KV; flash-attn when installed). Skipped without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.factories import PROMPTS

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.gpu


def test_cuda_matches_cpu(llama_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=128) as cpu:
        ref = cpu.generate(PROMPTS[:6], GREEDY)
    with LLM(llama_dir, num_kv_blocks=128, device="cuda") as gpu:
        assert gpu.core.executor.runner.backend.name == "torch"
        out = gpu.generate(PROMPTS[:6], GREEDY)
        gpu.core.check_integrity()
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed")
def test_flash_attn_backend_matches_cpu(llama_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=128) as cpu:
        ref = cpu.generate(PROMPTS[:6], GREEDY)
    with LLM(llama_dir, num_kv_blocks=16, block_size=256, device="cuda", dtype="bfloat16") as gpu:
        assert gpu.core.executor.runner.backend.name == "flash_attn"
        out = gpu.generate(PROMPTS[:6], GREEDY)
    # bf16 drifts from fp32; the first tokens must agree
    assert sum(o.token_ids[:4] == r.token_ids[:4] for o, r in zip(out, ref, strict=True)) >= 4
