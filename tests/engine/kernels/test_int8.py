"""Weight-only int8 (``quantization="int8"``): the quantisation itself, the compiled int8
GEMV and packed GEMM against torch on the dequantised weight, the ``int8_*`` linear
kernels and how they are chosen and refused, and a model's logits on them against fp32
on every architecture (the decoder stack on int8 weights, to the bit:
tests/engine/models/test_decoder_stack.py; through the cluster: tests/e2e/test_int8.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig, load_model_config
from engine.core.runner import ModelRunner
from engine.kernels import choice
from engine.kernels.choice import LinearShape, choose_kernel_plan, linear_shapes
from engine.kernels.cpu import GEMV_MAX_ROWS, NativeKernels
from engine.kernels.linear import KERNELS, KernelPlan, available_kernels
from engine.kernels.quant import quantize_int8
from engine.models.layers import ColumnParallelLinear, RowParallelLinear, linear_layers
from engine.tp.distributed import Group
from tests.engine.models.test_decoder_stack import _run, _steps

pytestmark = pytest.mark.timeout(120)


def test_each_row_gets_its_largest_magnitude_over_127_and_rounds_to_it() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 70)
    w[3] = 0.0  # a row of zeros: scale 1, weights 0
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scales.dtype == torch.float32 and q.shape == (40, 70)
    amax = w.abs().amax(dim=1)
    assert torch.equal(q.scales[3], torch.tensor(1.0)) and not q.q[3].any()
    rows = [i for i in range(40) if i != 3]
    torch.testing.assert_close(q.scales[rows], amax[rows] / 127)
    assert q.q.abs().max() == 127  # each row's largest weight lands on the end of the range
    error = (q.dequantize() - w).abs()
    assert bool((error <= q.scales[:, None] / 2 + 1e-7).all())  # round to nearest
    bf16 = quantize_int8(w.to(torch.bfloat16))  # any float dtype in, fp32 scales out
    assert bf16.scales.dtype == torch.float32


def test_what_cannot_be_quantised_is_refused() -> None:
    for bad in (torch.zeros(4), torch.zeros(2, 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="2-d float weight"):
            quantize_int8(bad)
    w = torch.ones(3, 3)
    w[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or an infinity"):
        quantize_int8(w)


def test_a_shard_is_the_whole_weight_quantised_then_sharded() -> None:
    """Row-parallel shards hold part rows: their scales are the whole rows' (recorded at
    load), so TP 2's int8 weights are TP 1's, split; column-parallel shards hold whole rows."""
    torch.manual_seed(1)
    full = torch.randn(24, 40)
    whole = quantize_int8(full)
    for rank in (0, 1):
        row = RowParallelLinear(40, 24, Group(None, rank, 2, "test"))
        row.load_weight("weight", full)
        row.set_kernel("int8_torch")
        assert torch.equal(row._prepared.q, whole.q[:, 20 * rank:20 * (rank + 1)])
        assert torch.equal(row._prepared.scales, whole.scales)
        column = ColumnParallelLinear(40, 24, Group(None, rank, 2, "test"))
        column.load_weight("weight", full)
        column.set_kernel("int8_torch")
        assert torch.equal(column._prepared.q, whole.q[12 * rank:12 * (rank + 1)])
        assert torch.equal(column._prepared.scales, whole.scales[12 * rank:12 * (rank + 1)])


SHAPES = [(768, 512), (100, 1408), (33, 129), (5, 3), (1, 1)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_the_int8_gemv_and_gemm_are_the_linear_on_the_dequantised_weight(
        kernels: NativeKernels, out_features: int, in_features: int, threads: int) -> None:
    """Rows for the GEMV (1-3) and for the GEMM (within one block of rows and across blocks
    and row tiles), output features past the last full panel, K past the vectors and the
    chunks, with and without bias, 2-d and 3-d; against float64 on ``q * scale``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(out_features * in_features)
        w = quantize_int8(torch.randn(out_features, in_features))
        panels = kernels.pack_panels(w.q)
        assert panels.dtype == torch.int8
        exact = w.dequantize().double()
        for bias in (None, torch.randn(out_features)):
            for rows in (*range(1, GEMV_MAX_ROWS + 1), 4, 15, 29, 300):
                x = torch.randn(rows, in_features)
                want = x.double() @ exact.T + (0 if bias is None else bias.double())
                got = kernels.gemm_packed_i8_checked(x, panels, w.scales, out_features, bias)
                assert got is not None
                torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
                gemv = kernels.gemv_i8_checked(x[None], w.q, w.scales, bias)
                assert (gemv is None) == (rows > GEMV_MAX_ROWS)
                if gemv is not None:
                    torch.testing.assert_close(gemv[0].double(), want, rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_int8_torch_in_float16_does_not_overflow_before_its_scales() -> None:
    """Each output is 127 / the row's largest weight times its value before the row's
    scale: in float16 that passes 65504 (here 1024 x 127) and became inf."""
    kernel = KERNELS["int8_torch"]
    weight = kernel.prepare(torch.full((2, 1024), 0.01, dtype=torch.float16))
    y = kernel.apply(torch.ones(3, 1024, dtype=torch.float16), weight, None)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    assert torch.allclose(y.float(), torch.full((3, 2), 10.24), rtol=1e-2)


def test_the_int8_kernels_leave_what_they_do_not_take_to_torch(kernels: NativeKernels) -> None:
    w = quantize_int8(torch.randn(8, 16))
    panels = kernels.pack_panels(w.q)
    for x in (torch.randn(16, 2).T, torch.randn(1, 16, dtype=torch.float64), torch.randn(1, 15)):
        assert kernels.gemv_i8_checked(x, w.q, w.scales, None) is None
        assert kernels.gemm_packed_i8_checked(x, panels, w.scales, 8, None) is None
    # the int8_packed kernel multiplies a strided x through torch, the same product
    prepared = KERNELS["int8_packed"].prepare(torch.randn(8, 16))
    x = torch.randn(16, 5).T
    want = KERNELS["int8_torch"].apply(x.contiguous(), prepared.weight, None)
    torch.testing.assert_close(KERNELS["int8_packed"].apply(x, prepared, None), want)


def test_int8_weights_take_the_int8_kernels_and_only_those(llama_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    int8 = ["int8_woq", "int8_torch", "int8_packed", "int8_packed_gemm"]
    assert available_kernels(cpu, torch.float32, "int8") == int8
    assert not set(int8) & set(available_kernels(cpu, torch.float32))
    model = load_model_config(llama_dir)
    with pytest.raises(ConfigError, match="quantization must be None or one of"):
        EngineConfig(model=model, quantization="int4")
    with pytest.raises(ConfigError, match="int8 weights take int8_packed, int8_packed_gemm, int8_woq or int8_torch"):
        EngineConfig(model=model, quantization="int8", linear_kernel="packed")
    with pytest.raises(ConfigError, match="does not multiply unquantised weights"):
        EngineConfig(model=model, linear_kernel="int8_packed")
    config = EngineConfig(model=model, quantization="int8")
    monkeypatch.setenv(choice.KERNEL_ENV, "packed")
    with pytest.raises(ValueError, match="does not multiply the weights of quantization='int8'"):
        choose_kernel_plan(config, 1, cache_path=tmp_path / "cache.json")
    monkeypatch.delenv(choice.KERNEL_ENV)
    timed: list[tuple[str, ...]] = []

    def measure(shape: LinearShape, kernels: list[str], dtype: torch.dtype) -> choice.Timings:
        timed.append(tuple(kernels))
        return {k: {m: [1.0 if k == "int8_packed" else 2.0] for m in shape.batch_sizes}
                for k in kernels}

    plan = choose_kernel_plan(config, 1, cache_path=tmp_path / "cache.json", measure=measure)
    assert set(timed) == {("int8_torch", "int8_packed")}
    assert plan.summary == "int8_packed" and plan.source == "measured"


def test_off_the_cpu_int8_weights_take_int8_torch_even_where_torch_has_weight_only_matmul(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A CUDA engine's plan is ``int8_torch`` (cuBLAS) whether or not torch has
    ``_weight_int8pack_mm`` for CUDA, whose kernel is one thread per output; nothing is
    measured there. (This CPU-only torch has no CUDA kernels: the availability is what is
    faked; tests/engine/test_gpu.py runs ``int8_woq`` forced.)"""
    import dataclasses

    config = EngineConfig(model=load_model_config(llama_dir), quantization="int8",
                          device="cuda")

    def measure(*args: object) -> choice.Timings:
        raise AssertionError("nothing is measured off the CPU")

    for woq_on_cuda in (False, True):
        monkeypatch.setitem(KERNELS, "int8_woq", dataclasses.replace(
            KERNELS["int8_woq"], available=lambda device, dtype, on=woq_on_cuda: on))
        plan = choose_kernel_plan(config, 1, cache_path=tmp_path / "cache.json",
                                  measure=measure)
        assert (plan.summary, plan.source) == ("int8_torch", "default")
    # int8_woq is available here (the last loop) but only to force, never measured nor a
    # default: torch's kernels are far slower
    assert not KERNELS["int8_woq"].measured
    forced = dataclasses.replace(config, linear_kernel="int8_woq")
    plan = choose_kernel_plan(forced, 1, cache_path=tmp_path / "cache.json", measure=measure)
    assert (plan.summary, plan.source) == ("int8_woq", "config")


def test_int8_woq_is_available_only_where_torchs_op_runs(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The dispatcher's word is not enough: one small product is tried, so a torch whose
    kernel refuses the inputs (or a device that is not there) never gets a plan."""
    from engine.kernels import linear

    cpu, woq = torch.device("cpu"), KERNELS["int8_woq"]
    assert woq.available(cpu, torch.float32) and not woq.available(cpu, torch.int32)
    linear._woq_runs.cache_clear()

    def refuses(*args: object) -> torch.Tensor:
        raise RuntimeError("expected scales to be bfloat16")

    monkeypatch.setattr(torch, "_weight_int8pack_mm", refuses)
    try:
        assert not woq.available(cpu, torch.float32)
    finally:
        linear._woq_runs.cache_clear()
    if not torch.cuda.is_available():
        assert not woq.available(torch.device("cuda"), torch.float32)


ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# On the tiny random-weight models (hidden 64: few weights per scale, near-tied logits)
# the worst logit of any step moved by 6.5-10% of the largest logit; quality on a trained
# model is bench.engine's (--quantization int8) to report.
MAX_RELATIVE_ERROR = 0.15
MEAN_RELATIVE_ERROR = 0.02


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_logits_stay_within_the_stated_tolerance_of_fp32(
        model_factory: Callable[..., Path], arch: str) -> None:
    config = EngineConfig(model=load_model_config(model_factory(arch)))
    shapes = [(s.out_features, s.in_features) for s in linear_shapes(config)]
    logits = {}
    for kernel in ("torch", "int8_torch", "int8_packed"):
        runner = ModelRunner(config, Group.single(), 24, KernelPlan.uniform(shapes, kernel, "config"))
        logits[kernel] = torch.cat(_run(runner, _steps(config.model.vocab_size)))
    fp32 = logits["torch"]
    scale = fp32.abs().max()
    for kernel in ("int8_torch", "int8_packed"):
        error = (logits[kernel] - fp32).abs()
        assert error.max() <= MAX_RELATIVE_ERROR * scale, (kernel, error.max() / scale)
        assert error.mean() <= MEAN_RELATIVE_ERROR * scale, (kernel, error.mean() / scale)
        assert error.max() > 0  # quantised: not the fp32 product
    # the compiled kernels and torch multiply by the same int8 weights
    torch.testing.assert_close(logits["int8_packed"], logits["int8_torch"], rtol=1e-4, atol=1e-4)


def test_llm_with_int8_weights_reads_a_quarter_of_the_bytes_and_generates(llama_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, quantization="int8") as llm:
        executor = llm.core.executor
        plan = executor.kernel_plan  # type: ignore[attr-defined]
        assert {k for _, _, k in plan.kernels} <= {"int8_torch", "int8_packed"}, plan
        model = executor.runner.model  # type: ignore[attr-defined]
        layers = linear_layers(model)
        fp32 = sum(4 * math.prod(layer.weight_shape) for layer in layers)
        assert sum(layer.weight_read_bytes for layer in layers) < 0.3 * fp32
        # the weights as loaded are freed (the tied-free tiny llama: every linear's)
        assert all(layer.weight.numel() == 0 for layer in layers)
        with pytest.raises(RuntimeError, match="released after int8 quantisation"):
            layers[0].set_kernel("torch")
        layers[0].set_kernel("int8_torch")  # another int8 kernel: from the int8 weight kept
        first, again = (llm.generate(["the int8 path", "a second prompt"], greedy)
                        for _ in range(2))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert all(len(r.token_ids) == 12 for r in first)


def test_a_tied_head_keeps_the_embedding_it_shares(model_factory: Callable[..., Path]) -> None:
    """qwen2's LM head is its input embedding: quantising the head frees nothing the
    embedding still gathers from; every other linear's weight as loaded is freed."""
    config = EngineConfig(model=load_model_config(model_factory("qwen2")), quantization="int8")
    shapes = [(s.out_features, s.in_features) for s in linear_shapes(config)]
    runner = ModelRunner(config, Group.single(), 24, KernelPlan.uniform(shapes, "int8_torch",
                                                                        "config"))
    model = runner.model
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.embed_tokens.weight.numel() > 0
    assert all(layer.weight.numel() == 0 for layer in linear_layers(model)
               if layer is not model.lm_head)
    logits = torch.cat(_run(runner, _steps(config.model.vocab_size)))
    assert bool(torch.isfinite(logits).all())
