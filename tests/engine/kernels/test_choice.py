"""Choosing linear kernels: forced by config or environment, measured once and cached per
machine and shape, and the leader's plan applied on every tensor-parallel rank."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import (
    LINEAR_KERNELS,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    load_model_config,
)
from engine.kernels.choice import (
    KERNEL_ENV,
    LinearShape,
    Timings,
    choose_kernel_plan,
    default_cache_path,
    linear_shapes,
    measure_kernels,
    pick_kernel,
)
from engine.kernels.linear import KERNELS, KernelPlan, available_kernels
from engine.kernels.quant import quantize_int8
from engine.models.layers import linear_layers
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(120)


class FakeMeasure:
    """Timings where ``winner(shape)`` is twice as fast as every other kernel."""

    def __init__(self, winner: dict[int, str]) -> None:
        self.winner = winner  # out_features -> kernel
        self.calls: list[LinearShape] = []

    def __call__(self, shape: LinearShape, kernels: Sequence[str], dtype: torch.dtype) -> Timings:
        self.calls.append(shape)
        fast = self.winner.get(shape.out_features, "torch")
        return {k: {m: [(1.0 if k == fast else 2.0) * m] * 3 for m in shape.batch_sizes}
                for k in kernels}


def refuse(shape: LinearShape, kernels: Sequence[str], dtype: torch.dtype) -> Timings:
    raise AssertionError(f"measured {shape} although the choice should not need it")


@pytest.fixture
def config(llama_dir: Path) -> EngineConfig:
    return EngineConfig(model=load_model_config(llama_dir))


@pytest.fixture(autouse=True)
def no_forced_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNEL_ENV, raising=False)


def test_config_names_every_kernel() -> None:
    assert set(LINEAR_KERNELS) == {"auto", *KERNELS}


@pytest.mark.parametrize("arch,overrides,tp", [
    ("llama", {}, 1), ("llama", {}, 2), ("qwen2", {}, 2), ("qwen3", {}, 1),
    ("llama", {"num_key_value_heads": 1}, 2), ("llama", {"tie_word_embeddings": True}, 2),
])
def test_shapes_match_the_models_linear_layers(model_factory: Callable[..., Path], arch: str,
                                               overrides: dict[str, Any], tp: int) -> None:
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models import build_model
    from engine.tp.distributed import Group

    cfg = EngineConfig(model=load_model_config(model_factory(arch, **overrides)),
                       parallel=ParallelConfig(tensor_parallel_size=tp))
    for rank in range(tp):
        model = build_model(cfg.model, Group(None, rank, tp, "test"), TorchAttentionBackend())
        built = {tuple(layer.weight.shape) for layer in linear_layers(model)}
        assert built == {(s.out_features, s.in_features) for s in linear_shapes(cfg, rank)}


def test_shapes_are_the_rank_shards_with_their_batch_sizes(config: EngineConfig) -> None:
    m = config.model
    shapes = {(s.out_features, s.in_features): s.batch_sizes for s in linear_shapes(config)}
    qkv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    assert shapes[(qkv, m.hidden_size)] == (1, 32, 256)
    assert shapes[(2 * m.intermediate_size, m.hidden_size)] == (1, 32, 256)
    assert shapes[(m.vocab_size, m.hidden_size)] == (1, 32)  # the LM head: one row per sequence
    tp2 = EngineConfig(model=m, parallel=ParallelConfig(tensor_parallel_size=2))
    halved = {(s.out_features, s.in_features) for s in linear_shapes(tp2)}
    assert (qkv // 2, m.hidden_size) in halved and (m.hidden_size, m.intermediate_size // 2) in halved


def test_forced_by_config_then_by_environment(config: EngineConfig, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "kernels.json"
    monkeypatch.setenv(KERNEL_ENV, "mm_t")
    plan = choose_kernel_plan(config, 1, cache_path=cache, measure=refuse)
    assert (plan.summary, plan.source) == ("mm_t", "env")
    assert {(o, i) for o, i, _ in plan.kernels} == {
        (s.out_features, s.in_features) for s in linear_shapes(config)}
    torch_config = EngineConfig(model=config.model, linear_kernel="torch")
    plan = choose_kernel_plan(torch_config, 1, cache_path=cache, measure=refuse)
    assert (plan.summary, plan.source) == ("torch", "config")
    assert not cache.exists()
    monkeypatch.setenv(KERNEL_ENV, "blas9000")
    with pytest.raises(ValueError, match=f"{KERNEL_ENV}='blas9000' is not a linear kernel"):
        choose_kernel_plan(config, 1, cache_path=cache, measure=refuse)


def test_onednn_cannot_be_forced_where_it_cannot_run(llama_dir: Path, tmp_path: Path) -> None:
    bf16 = EngineConfig(model=load_model_config(llama_dir, dtype="bfloat16"), linear_kernel="onednn")
    with pytest.raises(ValueError, match="cannot run here"):
        choose_kernel_plan(bf16, 1, cache_path=tmp_path / "k.json", measure=refuse)


def test_measured_once_then_cached_per_machine(config: EngineConfig, tmp_path: Path) -> None:
    cache = tmp_path / "pdserve" / "kernels.json"
    m = config.model
    fake = FakeMeasure({m.vocab_size: "onednn", m.hidden_size: "mm_t"})
    # 1. measured: every distinct shape timed once, the faster kernel per shape chosen
    plan = choose_kernel_plan(config, 1, cache_path=cache, measure=fake)
    assert plan.source == "measured" and len(fake.calls) == len(linear_shapes(config))
    assert plan.kernel_for(m.vocab_size, m.hidden_size) == "onednn"
    assert plan.kernel_for(m.hidden_size, m.hidden_size) == "mm_t"
    assert plan.summary.startswith("mixed: ")
    # 2. cached: the same plan without timing anything
    again = choose_kernel_plan(config, 1, cache_path=cache, measure=refuse)
    assert (again.kernels, again.source) == (plan.kernels, "cache")
    data = json.loads(cache.read_text())
    [(machine, entries)] = data["machines"].items()
    assert "threads=1" in machine and "dtype=float32" in machine and "cpu=" in machine
    assert all(e["kernel"] in KERNELS and set(e["seconds"]) >= {"torch", "mm_t"}
               for e in entries.values())
    # 3. another thread count is another machine key: measured again
    other = FakeMeasure({})
    assert choose_kernel_plan(config, 2, cache_path=cache, measure=other).summary == "torch"
    assert len(other.calls) == len(linear_shapes(config))
    assert len(json.loads(cache.read_text())["machines"]) == 2


def test_a_speculating_engine_runs_the_packed_gemm_at_every_row_count(
        config: EngineConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its verifying steps (1 + 4 rows) pass the GEMV's 3: every weight on the GEMM's
    kernel, nothing measured; a forced kernel still wins; guesses of 2 (3 rows) stay on
    the GEMV, measured as usual, and the measurement never times the *_gemm kernels."""
    if "packed_gemm" not in available_kernels(torch.device("cpu"), torch.float32):
        pytest.skip("the compiled kernels are unavailable here")
    cache = tmp_path / "kernels.json"

    def speculating(k: int, **kwargs: Any) -> EngineConfig:
        return EngineConfig(model=config.model, scheduler=SchedulerConfig(
            speculative_method="ngram", num_speculative_tokens=k, prompt_lookup_max=2),
            **kwargs)

    plan = choose_kernel_plan(speculating(4), 1, cache_path=cache, measure=refuse)
    assert (plan.summary, plan.source) == ("packed_gemm", "speculative")
    plan = choose_kernel_plan(speculating(4, quantization="int8"), 1, cache_path=cache,
                              measure=refuse)
    assert (plan.summary, plan.source) == ("int8_packed_gemm", "speculative")
    plan = choose_kernel_plan(speculating(4, linear_kernel="mm_t"), 1, cache_path=cache,
                              measure=refuse)
    assert (plan.summary, plan.source) == ("mm_t", "config")
    timed: list[Sequence[str]] = []

    def measure(shape: LinearShape, kernels: Sequence[str], dtype: torch.dtype) -> Timings:
        timed.append(kernels)
        return FakeMeasure({})(shape, kernels, dtype)

    plan = choose_kernel_plan(speculating(2), 1, cache_path=cache, measure=measure)
    assert plan.source == "measured" and timed
    assert all("packed" in k and not {"packed_gemm", "int8_packed_gemm"} & set(k)
               for k in timed)


def test_a_damaged_cache_is_measured_again(config: EngineConfig, tmp_path: Path) -> None:
    cache = tmp_path / "kernels.json"
    cache.write_text("{not json")
    fake = FakeMeasure({})
    assert choose_kernel_plan(config, 1, cache_path=cache, measure=fake).source == "measured"
    assert fake.calls and json.loads(cache.read_text())["version"] == 1


def test_default_cache_path_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_path() == tmp_path / "pdserve" / "linear_kernels.json"


def test_pick_kernel_weighs_each_batch_size_relative_to_its_fastest() -> None:
    # torch wins the big prefill chunk by a little, loses batch-1 and batched decode by 2x
    timings = {"torch": {1: [2.0], 32: [20.0], 256: [90.0]},
               "onednn": {1: [1.0], 32: [10.0], 256: [100.0]}}
    assert pick_kernel(timings) == "onednn"
    # within 3%: a tie, the first (torch: no weight copy) wins
    assert pick_kernel({"torch": {1: [1.02]}, "mm_t": {1: [1.0]}}) == "torch"
    assert pick_kernel({"torch": {1: [1.1]}, "mm_t": {1: [1.0]}}) == "mm_t"


def test_pick_kernel_ignores_spells_of_load() -> None:
    # onednn is 1.5x faster; a spell of other work stalled 5 of its 8 calls (10x)
    timings = {"torch": {1: [3.0] * 8}, "onednn": {1: [2.0, 20.0, 20.0, 20.0, 2.0, 20.0, 20.0, 2.0]}}
    assert pick_kernel(timings) == "onednn"
    # and one lucky torch call (best times would pick torch) does not decide either
    lucky = {"torch": {1: [3.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]}, "onednn": {1: [2.0] * 8}}
    assert pick_kernel(lucky) == "onednn"


def test_real_measurement_times_every_kernel_at_every_batch_size() -> None:
    shape = LinearShape(96, 64, (1, 8))
    timings = measure_kernels(shape, ["torch", "mm_t"], torch.float32)
    assert set(timings) == {"torch", "mm_t"}
    assert all(set(t) == {1, 8} and all(4 <= len(v) <= 90 and min(v) > 0 for v in t.values())
               for t in timings.values())
    assert len(timings["torch"][8]) == len(timings["mm_t"][8])  # interleaved one by one


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_every_kernel_computes_the_same_linear(kernel: str) -> None:
    """At 2 rows (the GEMV's, where a kernel has it) and 5, and on what its fast paths do
    not take: a strided x, a strided bias, no rows; a quantising kernel (int8_*) the
    product by the weight it quantised."""
    k = KERNELS[kernel]
    if not k.available(torch.device("cpu"), torch.float32):
        pytest.skip(f"{kernel} cannot run here")
    loaded, bias = torch.randn(48, 32), torch.randn(48)
    prepared = k.prepare(loaded)
    # what the kernel multiplies by: the weight, or (int8_*) its int8 rounding
    weight = loaded if k.quantization is None else quantize_int8(loaded).dequantize()
    for rows in (2, 5):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(k.apply(x, prepared, bias), x @ weight.T + bias)
        torch.testing.assert_close(k.apply(x[None], prepared, None), (x @ weight.T)[None])
        strided = torch.randn(32, rows).T
        torch.testing.assert_close(k.apply(strided, prepared, bias), strided @ weight.T + bias)
        wide_bias = torch.randn(96)[::2]
        torch.testing.assert_close(k.apply(x, prepared, wide_bias), x @ weight.T + wide_bias)
    assert k.apply(torch.randn(0, 32), prepared, bias).shape == (0, 48)


def test_the_leaders_choice_reaches_every_rank(llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """A plan only the leader could have made (a fake measurement in the leader process)
    is what the follower's model runs."""
    import engine.kernels.choice

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: measured
    m = load_model_config(llama_dir)
    fake = FakeMeasure({m.vocab_size // 2: "mm_t", m.hidden_size: "mm_t"})
    monkeypatch.setattr(engine.kernels.choice, "measure_kernels", fake)
    config = EngineConfig(model=m, parallel=ParallelConfig(tensor_parallel_size=2),
                          rank_plugin="tests.engine.tp.rank_plugin_example:make")
    from engine.core.engine_core import EngineCore

    core = EngineCore(config)
    try:
        leader = core.executor.runner
        assert leader.kernel_plan is not None and leader.kernel_plan.source == "measured"
        assert {layer.kernel_name for layer in linear_layers(leader.model)} == {"torch", "mm_t"}
        replies = [r.decode() for r in core.call_ranks(b"kernels")]
        expected = ";".join(f"{o},{i},{k}" for o, i, k in leader.kernel_plan.kernels) + "|measured"
        assert replies == [expected, expected]
    finally:
        core.shutdown()


def test_forced_kernels_generate_the_same_tokens(llama_dir: Path) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for kernel in sorted(KERNELS):
        quantization = KERNELS[kernel].quantization
        with LLM(llama_dir, num_kv_blocks=64, linear_kernel=kernel,
                 quantization=quantization) as llm:
            assert llm.core.executor.runner.linear_kernel == kernel
            tokens[kernel] = [r.token_ids for r in llm.generate(PROMPTS[:3], greedy)]
    # the same weights give the same tokens: as loaded (torch's), or int8 (int8_torch's)
    for kernel, got in tokens.items():
        assert got == tokens["int8_torch" if KERNELS[kernel].quantization else "torch"], kernel


def test_a_plan_without_a_shape_is_refused() -> None:
    plan = KernelPlan(((4, 4, "torch"),), "config")
    with pytest.raises(KeyError, match=r"\[8, 4\]"):
        plan.kernel_for(8, 4)
    with pytest.raises(ValueError, match="unknown linear kernels"):
        KernelPlan(((4, 4, "cublas"),), "config")
