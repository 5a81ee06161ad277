"""GPU paths (CUDA SDPA over gathered KV; int8 weights through cuBLAS and, forced,
torch's weight-only int8 matmul; flash-attn when installed). Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.factories import PROMPTS, REPO_ROOT

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


def test_int8_weights_on_cuda_give_the_cpus_int8_tokens(llama_dir: Path) -> None:
    """``quantization="int8"`` on CUDA multiplies by the int8 weights with ``int8_torch``
    by default, and with torch's fused op (``int8_woq``) where forced and torch has it for
    CUDA; each gives the CPU's int8 tokens."""
    import torch

    from engine.kernels.linear import KERNELS

    with LLM(llama_dir, num_kv_blocks=128, quantization="int8", linear_kernel="int8_torch") as cpu:
        ref = cpu.generate(PROMPTS[:6], GREEDY)
    kernels = ["auto"] + (["int8_woq"] if KERNELS["int8_woq"].available(
        torch.device("cuda"), torch.float32) else [])
    for kernel in kernels:
        with LLM(llama_dir, num_kv_blocks=128, device="cuda", quantization="int8",
                 linear_kernel=kernel) as gpu:
            expected = "int8_torch" if kernel == "auto" else kernel
            assert gpu.core.executor.runner.linear_kernel == expected
            out = gpu.generate(PROMPTS[:6], GREEDY)
            gpu.core.check_integrity()
        assert [r.token_ids for r in out] == [r.token_ids for r in ref], kernel


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn not installed")
def test_flash_attn_backend_matches_cpu(llama_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=128) as cpu:
        ref = cpu.generate(PROMPTS[:6], GREEDY)
    with LLM(llama_dir, num_kv_blocks=16, block_size=256, device="cuda", dtype="bfloat16") as gpu:
        assert gpu.core.executor.runner.backend.name == "flash_attn"
        out = gpu.generate(PROMPTS[:6], GREEDY)
    # bf16 drifts from fp32; the first tokens must agree
    assert sum(o.token_ids[:4] == r.token_ids[:4] for o, r in zip(out, ref, strict=True)) >= 4


def test_a_follower_sees_only_its_own_gpu() -> None:
    # $PDSERVE_RANK_GPUS (set by pdserve up --ray): rank 1 narrows CUDA_VISIBLE_DEVICES to
    # its own id before CUDA starts, and binds cuda:0 (one GPU here: both ranks name "0")
    code = ("import os, torch\nfrom engine.tp.rank_main import _bind_gpu\n_bind_gpu(1)\n"
            "print(os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count(),"
            " torch.cuda.current_device())\n")
    env = {**os.environ, "PDSERVE_RANK_GPUS": "0,0", "CUDA_VISIBLE_DEVICES": "0"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1", "0"]
