"""The fp8 KV cache (``kv_cache_dtype="fp8"`` = ``"fp8_e4m3"``, ``"fp8_e5m2"``;
``engine.attention.kv_quant``): each value rounds to the nearest fp8 number and saturates at
the format's largest; a model's logits against fp32 on every architecture; a block takes a
quarter of fp32's bytes exactly; tensor parallelism (TP 2 gives TP 1's tokens); the
settings refused. Quality on a trained model is ``bench.quality --kv-cache-dtype fp8``'s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.kv_quant import FP8_DTYPES, dequantize, is_quantized, quantize
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, write_kv
from engine.config import CacheConfig, ConfigError, EngineConfig, load_model_config
from engine.core.runner import kv_bytes_per_block
from engine.kernels.cpu import NativeKernels
from tests.engine.attention.test_kv_int8 import relative_logit_errors
from tests.engine.kernels.test_int8 import ARCHS

pytestmark = pytest.mark.timeout(120)

# (torch dtype, mantissa bits, largest finite value)
FORMATS = {"fp8_e4m3": (torch.float8_e4m3fn, 3, 448.0), "fp8_e5m2": (torch.float8_e5m2, 2, 57344.0)}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_values_round_to_the_nearest_fp8_number_and_saturate(name: str) -> None:
    dtype, mantissa, largest = FORMATS[name]
    torch.manual_seed(0)
    x = torch.randn(6, 3, 32) * torch.logspace(-1, 1, 6).view(6, 1, 1)
    x[0, 0, :2] = torch.tensor([largest * 10, -largest * 3])  # beyond the format: saturated
    stored = quantize(x, dtype)
    assert stored.dtype == dtype and stored.shape == x.shape and is_quantized(stored)
    back = dequantize(stored)
    assert back.dtype == torch.float32 and torch.isfinite(back).all()
    assert back[0, 0, :2].tolist() == [largest, -largest]
    normal = x.abs() >= torch.finfo(dtype).tiny
    normal[0, 0, :2] = False
    relative = ((back - x).abs() / x.abs())[normal]
    assert relative.max() <= 2.0 ** -(mantissa + 1) + 1e-6  # half a step of the mantissa
    assert relative.max() > 2.0 ** -(mantissa + 3)  # it did round
    assert dequantize(quantize(x.bfloat16(), dtype), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(8, 2, 32), (4, 4, 16), (8, 1, 128)])
def test_the_compiled_fp8_decode_attention_is_the_fp32_one_over_the_widened_cache(
        kernels: NativeKernels, name: str, q_heads: int, kv_heads: int, head_dim: int) -> None:
    """The kernel widens fp8 bytes in registers, exactly as torch converts them (every
    finite code, subnormals and both zeros included)."""
    dtype = FORMATS[name][0]
    torch.manual_seed(q_heads * head_dim)
    blocks, block_size = 30, 16
    cache = quantize(torch.randn(2, blocks, block_size, kv_heads, head_dim) * 4, dtype)
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[torch.isfinite(codes.view(dtype).float())]
    cache.view(torch.uint8).view(-1)[: len(finite)] = finite  # block 0 holds every code
    q = torch.randn(5, q_heads, head_dim)
    tables = torch.randint(0, blocks, (5, 4))
    tables[0, 0] = 0
    lens = torch.tensor([1, 17, 33, 64, 40])
    assert kernels.supports_decode_attention(q, cache)
    got = kernels.paged_decode_attention(q, cache, tables, lens, 0.2)
    fp32 = kernels.paged_decode_attention(q, dequantize(cache), tables, lens, 0.2)
    # the same sums, up to where the compiler fused a multiply into an add (block 0's
    # values reach the format's largest, so the outputs are large)
    atol = 1e-5 * float(fp32.abs().max())
    torch.testing.assert_close(got, fp32, rtol=1e-5, atol=atol)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64),
                             num_decode_tokens=5, decode_block_tables=tables,
                             decode_context_lens=lens, max_decode_context_len=64, prefills=[])
    torched = TorchAttentionBackend()._decode(q, cache, meta, 0.2)
    torch.testing.assert_close(torched, fp32, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_compiled_attention_reads_every_fp8_code_as_torch_converts_it(
        kernels: NativeKernels, name: str) -> None:
    """One key (zeros) and its value holding each of the 256 codes: the output is the
    value as read, NaN and infinity included."""
    dtype = FORMATS[name][0]
    codes = torch.arange(256, dtype=torch.uint8)
    cache = torch.zeros(2, 1, 16, 1, 256, dtype=torch.uint8)
    cache[1, 0, 0, 0] = codes
    out = kernels.paged_decode_attention(torch.zeros(1, 1, 256), cache.view(dtype),
                                         torch.tensor([[0]]), torch.tensor([1]), 1.0)
    torch.testing.assert_close(out[0, 0], codes.view(dtype).float(), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_compiled_kv_write_writes_the_bytes_torch_writes(kernels: NativeKernels,
                                                              name: str) -> None:
    """Rounding half to even at every scale, subnormals, both zeros, saturation, NaN."""
    dtype, _, largest = FORMATS[name]
    torch.manual_seed(5)
    values = torch.cat([torch.randn(512) * 10.0 ** e for e in range(-7, 6)])
    special = torch.tensor([0.0, -0.0, largest, -largest, largest * 1.01, -largest * 9,
                            float("inf"), float("-inf"), float("nan"), 1e-30, -1e-30,
                            2.0 ** -6, 2.0 ** -10, 2.0 ** -9 * 1.5, 2.0 ** -16 * 2.5])
    x = torch.cat([values, special, torch.zeros(-(len(values) + len(special)) % 32)])
    k = x.view(-1, 2, 16)
    v = -k.flip(0)
    blocks = -(-k.shape[0] // 4)
    cache = torch.zeros(2, blocks, 4, 2, 16, dtype=dtype)
    slots = torch.randperm(blocks * 4)[: k.shape[0]]
    assert kernels.write_kv(cache, k, v, slots)
    expected = torch.zeros_like(cache)
    write_kv(expected, k, v, slots)  # torch's conversion (kv_quant.quantize)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(IndexError):
        kernels.write_kv(cache, k, v, torch.full_like(slots, blocks * 4))


# On the tiny random-weight models (measured 2026-12-07, the first chunk attending its K/V
# as the cache holds them: the worst logit of any step moved by 2.9% (qwen3) to 37% (qwen2,
# whose K/V biases make larger values) of the largest logit, 0.4-3.2% on average): e4m3
# keeps 3 mantissa bits, where int8's per-token scale keeps about 7 (int8: 0.7-5.4%, mean
# 0.1-0.6%).
MAX_RELATIVE_ERROR = 0.45
MEAN_RELATIVE_ERROR = 0.04


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_kv_logits_stay_within_the_stated_tolerance_of_fp32(
        model_factory: Callable[..., Path], arch: str) -> None:
    worst, mean = relative_logit_errors(model_factory(arch), "fp8", torch.float8_e4m3fn)
    assert worst <= MAX_RELATIVE_ERROR and mean <= MEAN_RELATIVE_ERROR, (worst, mean)


def test_a_block_takes_a_quarter_of_the_bytes_and_tp_2_gives_tp_1s_tokens(
        llama_dir: Path) -> None:
    model = load_model_config(llama_dir)
    fp32 = kv_bytes_per_block(EngineConfig(model=model))
    for name in FORMATS:
        config = EngineConfig(model=model, cache=CacheConfig(kv_cache_dtype=name))
        assert kv_bytes_per_block(config) * 4 == fp32
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's name
    with pytest.raises(ConfigError, match="an fp8 cache travels as it lies"):
        CacheConfig(kv_cache_dtype="fp8", kv_transfer_dtype="int8")
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["an fp8 cache", "holds each token's keys and values in a byte each"]
    with LLM(llama_dir, kv_cache_dtype="fp8") as one:
        expected = [r.token_ids for r in one.generate(prompts, greedy)]
    with LLM(llama_dir, kv_cache_dtype="fp8", tensor_parallel_size=2) as two:
        assert [r.token_ids for r in two.generate(prompts, greedy)] == expected
    assert len(FP8_DTYPES) == 2
