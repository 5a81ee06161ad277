"""Parity with Hugging Face transformers on tiny checkpoints of each architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from tests.factories import PROMPTS, assert_greedy_match, hf_greedy

transformers = pytest.importorskip("transformers")

ARCH_CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mqa": ("llama", {"num_key_value_heads": 1}),
}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(ARCH_CASES))
def case(request: pytest.FixtureRequest, model_factory: Callable[..., Path]) -> Any:
    arch, overrides = ARCH_CASES[request.param]
    model_dir = model_factory(arch, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    llm = LLM(model_dir, num_kv_blocks=512, max_num_batched_tokens=256)
    yield model_dir, hf, llm
    llm.shutdown()


def test_prefill_and_decode_logits_match(case: Any) -> None:
    # 1. prefill 8 mixed-length prompts in one step through the paged path
    _, hf, llm = case
    core = llm.core
    prompts = [llm.encode(p) for p in PROMPTS[:8]]
    for i, ids in enumerate(prompts):
        core.add_request(f"logits-{i}", ids, GREEDY)
    out = core.scheduler.schedule()
    assert len(out.prefills) + len(out.decodes) == len(prompts)
    logits = core.executor.execute(out.chunks)
    # 2. compare with HF's last-token logits, each prompt unpadded
    with torch.no_grad():
        ref = [hf(torch.tensor([ids])).logits[0, -1] for ids in prompts]
    # rows follow the flat batch order (decodes first), so map them back by request id
    order = [int(c.request_id.split("-")[1]) for c in out.chunks]
    for row, i in enumerate(order):
        torch.testing.assert_close(logits[row], ref[i], atol=2e-4, rtol=1e-4)
    # 3. one decode step with the greedy tokens: compare again
    sampled = logits.argmax(-1).tolist()
    next_ids = dict(zip(order, sampled, strict=True))
    core.scheduler.update(out, sampled)
    out2 = core.scheduler.schedule()
    assert len(out2.decodes) == len(prompts)
    logits2 = core.executor.execute(out2.chunks)
    with torch.no_grad():
        for row, chunk in enumerate(out2.chunks):
            i = int(chunk.request_id.split("-")[1])
            ref2 = hf(torch.tensor([prompts[i] + [next_ids[i]]])).logits[0, -1]
            torch.testing.assert_close(logits2[row], ref2, atol=2e-4, rtol=1e-4)
    for i in range(len(prompts)):
        core.abort_request(f"logits-{i}")
    core.check_integrity()
    assert core.kv_usage().in_use == 0


def _reference(hf: Any, llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[Any]]]:
    return [hf_greedy(hf, llm.encode(p), GREEDY.max_tokens) for p in prompts]


def test_greedy_continuations_match(case: Any) -> None:
    _, hf, llm = case
    prompts = PROMPTS[:8]
    results = llm.generate(prompts, GREEDY)
    for res, (ref, ref_logits) in zip(results, _reference(hf, llm, prompts), strict=True):
        assert res.finish_reason == "length"
        assert len(res.token_ids) == 32
        assert_greedy_match(res.token_ids, ref, ref_logits)
    llm.core.check_integrity()


def test_greedy_with_preemption_matches(model_factory: Callable[..., Path]) -> None:
    model_dir = model_factory("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = PROMPTS[:8]
    # 8 requests of up to ~60 tokens need ~4 blocks each; 14 blocks force preemptions
    with LLM(model_dir, num_kv_blocks=14, block_size=16) as llm:
        results = llm.generate(prompts, GREEDY)
        assert llm.stats.num_preemptions >= 1
        for res, (ref, ref_logits) in zip(results, _reference(hf, llm, prompts), strict=True):
            assert_greedy_match(res.token_ids, ref, ref_logits)
        llm.core.check_integrity()
        assert llm.core.kv_usage().in_use == 0


def test_shared_prefix_is_cached_and_unchanged(case: Any) -> None:
    _, hf, llm = case
    prefix = "System: you are a helpful assistant. Answer briefly and precisely. " * 2
    prompts = [prefix + tail for tail in ("What is 2+2?", "Name a colour.", "Say hi.")]
    first = llm.generate(prompts[:1], GREEDY)
    second = llm.generate(prompts, GREEDY)
    assert second[0].num_cached_tokens > 0
    assert all(r.num_cached_tokens >= 16 for r in second)
    assert second[0].token_ids == first[0].token_ids
    for res, (ref, ref_logits) in zip(second, _reference(hf, llm, prompts), strict=True):
        assert_greedy_match(res.token_ids, ref, ref_logits)


def test_torch_and_onednn_linear_kernels_agree(llama_dir: Path) -> None:
    """The packed oneDNN path and plain F.linear give the same tokens (both forced)."""
    prompts = PROMPTS[:4]
    with LLM(llama_dir, num_kv_blocks=128, linear_kernel="torch") as plain:
        assert plain.core.executor.runner.linear_kernel == "torch"
        ref = plain.generate(prompts, GREEDY)
    with LLM(llama_dir, num_kv_blocks=128, linear_kernel="onednn") as packed:
        assert packed.core.executor.runner.linear_kernel == "onednn"
        out = packed.generate(prompts, GREEDY)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]


def test_one_to_three_streams_through_the_compiled_decoder_stack_match(
        case: Any, step_rows: list[int]) -> None:
    """Batch 1 to 3 decode steps on the CPU fast path (engine.models.decoder_stack)."""
    model_dir, hf, _ = case
    rows = step_rows
    with LLM(model_dir, num_kv_blocks=128, linear_kernel="onednn_gemv") as llm:
        for prompts in (PROMPTS[:1], PROMPTS[1:4]):
            results = llm.generate(prompts, GREEDY)
            for res, (ref, ref_logits) in zip(results, _reference(hf, llm, prompts), strict=True):
                assert_greedy_match(res.token_ids, ref, ref_logits)
        llm.core.check_integrity()
    assert rows.count(1) >= GREEDY.max_tokens - 1  # the single stream, all its decode steps
    qk_norm = hf.config.model_type == "qwen3"  # more rows go through the per-layer forward
    assert (3 in rows) != qk_norm


def test_many_streams_through_the_compiled_decoder_stack_on_the_packed_kernel_match(
        case: Any, step_rows: list[int]) -> None:
    """Every decode batch (8 streams down to 1) in one compiled call, the linears on the
    packed GEMM past the GEMV's rows."""
    from engine.kernels.cpu import GEMV_MAX_ROWS

    model_dir, hf, _ = case
    rows = step_rows
    prompts = PROMPTS[:8]
    with LLM(model_dir, num_kv_blocks=128, linear_kernel="packed") as llm:
        results = llm.generate(prompts, GREEDY)
        for res, (ref, ref_logits) in zip(results, _reference(hf, llm, prompts), strict=True):
            assert_greedy_match(res.token_ids, ref, ref_logits)
        llm.core.check_integrity()
    qk_norm = hf.config.model_type == "qwen3"  # one row at a time only (its per-head norms)
    assert (max(rows, default=0) > GEMV_MAX_ROWS) != qk_norm
