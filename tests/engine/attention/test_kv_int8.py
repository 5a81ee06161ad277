"""The int8 KV cache (``kv_cache_dtype="int8"``, ``engine.attention.kv_quant``): the
quantisation of each token's K/V per head, the compiled decode attention over int8 slots
against the fp32 kernel over the same values dequantised (and the torch path against
both), a model's logits against fp32 on every architecture, the bytes a block takes, and
tensor parallelism (each rank quantises its own heads: TP 2 gives TP 1's tokens)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.kv_quant import (
    SCALE_BYTES,
    dequantize,
    dequantize_torch,
    quantize,
    quantize_torch,
    slot_bytes,
)
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import CacheConfig, ConfigError, EngineConfig, load_model_config
from engine.core.runner import ModelRunner, kv_bytes_per_block
from engine.kernels.cpu import NativeKernels
from engine.tp.distributed import Group
from tests.engine.kernels.test_int8 import ARCHS
from tests.engine.models.test_decoder_stack import _plan, _run, _steps

pytestmark = pytest.mark.timeout(120)


def test_each_token_and_head_keeps_its_values_within_half_a_step_of_its_scale() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 3, 32) * torch.linspace(0.01, 10, 7).view(7, 1, 1)
    x[2, 1] = 0.0  # all zeros: stored as zeros
    slots = quantize(x)
    assert slots.dtype == torch.uint8 and slots.shape == (7, 3, slot_bytes(32)) == (7, 3, 36)
    scale = slots[..., 32:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale[[0, 1, 3]], x[[0, 1, 3]].abs().amax(-1, keepdim=True) / 127)
    back = dequantize(slots)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert ((back - x).abs() <= scale / 2 + 1e-7).all()
    assert not back[2, 1].any()
    assert dequantize(quantize(x.bfloat16()), torch.bfloat16).dtype == torch.bfloat16
    assert SCALE_BYTES == 4


def _metadata(tables: torch.Tensor, lens: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64),
                             num_decode_tokens=len(lens), decode_block_tables=tables,
                             decode_context_lens=lens, max_decode_context_len=int(lens.max()),
                             prefills=[])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 16), (8, 1, 128)])
def test_the_compiled_int8_decode_attention_is_the_fp32_one_over_the_dequantised_cache(
        kernels: NativeKernels, q_heads: int, kv_heads: int, head_dim: int, threads: int) -> None:
    torch.manual_seed(q_heads * head_dim)
    blocks, block_size = 30, 16
    cache = quantize(torch.randn(2, blocks, block_size, kv_heads, head_dim))
    q = torch.randn(5, q_heads, head_dim)
    tables = torch.randint(0, blocks, (5, 4))
    lens = torch.tensor([1, 17, 33, 64, 40])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernels.supports_decode_attention(q, cache)
        int8 = kernels.paged_decode_attention(q, cache, tables, lens, 0.2)
        fp32 = kernels.paged_decode_attention(q, dequantize(cache), tables, lens, 0.2)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(int8, fp32, rtol=1e-5, atol=1e-5)
    torched = TorchAttentionBackend()._decode(q, cache, _metadata(tables, lens), 0.2)
    torch.testing.assert_close(torched, fp32, rtol=1e-5, atol=1e-5)


MAX_RELATIVE_ERROR = 0.10
MEAN_RELATIVE_ERROR = 0.01


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_kv_logits_stay_within_the_stated_tolerance_of_fp32(
        model_factory: Callable[..., Path], arch: str) -> None:
    worst, mean = relative_logit_errors(model_factory(arch), "int8", torch.uint8)
    assert worst <= MAX_RELATIVE_ERROR and mean <= MEAN_RELATIVE_ERROR, (worst, mean)


def relative_logit_errors(model_dir: Path, kv_cache_dtype: str, cache_dtype: torch.dtype
                          ) -> tuple[float, float]:
    """The largest and the mean logit error (÷ the largest fp32 logit) of prefill then
    decode steps (reading the cache the prefill wrote) over a ``kv_cache_dtype`` cache
    (a tensor of ``cache_dtype``) against fp32's; never 0 (the decode steps read quantised
    keys and values)."""
    model = load_model_config(model_dir)
    logits = {}
    for dtype in ("auto", kv_cache_dtype):
        config = EngineConfig(model=model, cache=CacheConfig(kv_cache_dtype=dtype))
        runner = ModelRunner(config, Group.single(), 24, _plan(config, "torch"))
        assert runner.kv_cache.dtype == (cache_dtype if dtype != "auto" else torch.float32)
        logits[dtype] = torch.cat(_run(runner, _steps(model.vocab_size)))
    fp32, scale = logits["auto"], logits["auto"].abs().max()
    error = (logits[kv_cache_dtype] - fp32).abs()
    assert error.max() > 0
    return float(error.max() / scale), float(error.mean() / scale)


def test_a_block_takes_a_quarter_of_the_bytes_and_tp_2_gives_tp_1s_tokens(
        llama_dir: Path) -> None:
    model = load_model_config(llama_dir)
    fp32 = kv_bytes_per_block(EngineConfig(model=model))
    int8 = kv_bytes_per_block(EngineConfig(model=model, cache=CacheConfig(kv_cache_dtype="int8")))
    assert int8 / fp32 == (model.head_dim + 4) / (4 * model.head_dim)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp4")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["an int8 cache", "holds each token's keys and values"]
    with LLM(llama_dir, kv_cache_dtype="int8") as one:
        expected = [r.token_ids for r in one.generate(prompts, greedy)]
    with LLM(llama_dir, kv_cache_dtype="int8", tensor_parallel_size=2) as two:
        assert [r.token_ids for r in two.generate(prompts, greedy)] == expected


def test_the_compiled_kv_write_quantises_to_the_bytes_torch_writes(kernels: NativeKernels) -> None:
    torch.manual_seed(3)
    cache = torch.zeros(2, 6, 4, 3, 36, dtype=torch.uint8)
    expected = cache.clone()
    k, v = torch.randn(5, 3, 32) * 3, torch.randn(5, 3, 32)
    k[1, 2] = 0.0  # an all-zero head
    v[2, 0, 5] = 1e-30  # tiny values
    slots = torch.tensor([0, 7, 23, 11, 4])
    assert kernels.write_kv(cache, k, v, slots)
    expected[0].view(-1, 3, 36)[slots] = quantize_torch(k)
    expected[1].view(-1, 3, 36)[slots] = quantize_torch(v)
    assert torch.equal(cache, expected)
    with pytest.raises(IndexError):
        kernels.write_kv(cache, k, v, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("head_dim", [64, 72, 5])
def test_the_compiled_quantiser_and_dequantiser_are_torchs(kernels: NativeKernels,
                                                            head_dim: int) -> None:
    """``kv_quant.quantize``/``dequantize``'s compiled paths (what the KV transfer's wire
    quantisation runs) give torch's bytes and values: vector lanes and a scalar tail,
    all-zero heads, tiny and huge magnitudes, ties rounded half to even."""
    torch.manual_seed(5)
    x = torch.randn(7, 3, 4, head_dim)
    x[0, 0, 0] = 0.0
    x[1] *= 1e-30
    x[2] *= 1e30
    x[3, 0, 0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: ties at .5
    slots = kernels.quantize_kv(x)
    assert slots is not None and torch.equal(slots, quantize_torch(x))
    assert torch.equal(quantize(x), slots)
    assert slots[3, 0, 0, :4].view(torch.int8).tolist() == [127, 0, 2, -2]
    back = kernels.dequantize_kv(slots)
    assert back is not None and torch.equal(back, dequantize_torch(slots))
    assert torch.equal(dequantize(slots), back)
    assert kernels.quantize_kv(x.double()) is None and kernels.dequantize_kv(back) is None


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_over_a_quantised_cache_a_prompts_logprobs_do_not_depend_on_its_chunking(
        llama_dir: Path, kv_cache_dtype: str) -> None:
    """The first chunk of a prompt attends to its K/V as the cache holds them, as the
    later chunks do: one chunk and 16-token chunks give the same prompt logprobs (before,
    up to 0.19 nats apart here) and tokens."""
    prompt = [(7 * i + 3) % 200 + 5 for i in range(60)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0, logprobs=0)
    runs = []
    for chunk in (16, 512):
        with LLM(llama_dir, kv_cache_dtype=kv_cache_dtype,
                 max_num_batched_tokens=chunk) as llm:
            out = llm.generate([prompt], params)[0]
        assert out.prompt_logprobs is not None and out.logprobs is not None
        runs.append((out.token_ids, [p.logprob for p in out.prompt_logprobs if p is not None]
                     + [p.logprob for p in out.logprobs]))
    (tokens, cut), (whole_tokens, whole) = runs
    assert tokens == whole_tokens and len(cut) == len(whole) == 59 + 8
    assert max(abs(a - b) for a, b in zip(cut, whole, strict=True)) <= 1e-5
