"""The CPU decode fast path (``engine.models.decoder_stack``): the whole decoder stack (with
the embedding, RoPE lookup and final norm) in one compiled call at batch 1 to 3, and at
any decode batch up to ``STACK_MAX_ROWS`` with every linear on the ``packed`` kernel.
It must give the per-layer forward's logits and KV
cache to the bit, run only where the per-layer forward would run the same kernels, follow
a new cache or kernel plan, and check what it is handed before writing anything. Parity
with Hugging Face through it: tests/engine/test_hf_parity.py."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import ForwardContext, forward_context
from engine.config import CacheConfig, EngineConfig, load_model_config
from engine.core.runner import ModelRunner
from engine.core.scheduler import ScheduledChunk
from engine.kernels.choice import linear_shapes
from engine.kernels.cpu import GEMV_MAX_ROWS, STACK_MAX_ROWS, DecoderLayers, NativeKernels
from engine.kernels.linear import KernelPlan
from engine.models import decoder_stack
from engine.models.layers import apply_kernel_plan
from engine.tp.distributed import Group

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
ARCHS = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
         "mqa": ("llama", {"num_key_value_heads": 1}),
         # widths off the GEMV's groups of 4 rows and the 16-float vectors (their tails)
         "odd-widths": ("llama", {"hidden_size": 70, "intermediate_size": 99,
                                  "num_attention_heads": 5, "num_key_value_heads": 1,
                                  "head_dim": 16}),
         # head_dim 128, 8 query heads per KV head
         "wide-heads": ("llama", {"hidden_size": 128, "num_attention_heads": 8,
                                  "num_key_value_heads": 1, "head_dim": 128})}


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=load_model_config(model_dir))


def _plan(config: EngineConfig, kernel: str) -> KernelPlan:
    return KernelPlan.uniform([(s.out_features, s.in_features) for s in linear_shapes(config)],
                              kernel, "config")


def _runner(config: EngineConfig, kernel: str = "onednn_gemv", blocks: int = 24) -> ModelRunner:
    return ModelRunner(config, Group.single(), blocks, _plan(config, kernel))


class Seq:
    """One request's tokens and blocks, as the scheduler would hand them to the runner."""

    def __init__(self, name: str, prompt: list[int], first_block: int) -> None:
        self.name, self.tokens, self.first_block = name, list(prompt), first_block
        self.computed = 0

    def chunk(self) -> ScheduledChunk:
        new = self.tokens[self.computed:]
        blocks = tuple(range(self.first_block, self.first_block + -(-len(self.tokens) // BLOCK)))
        chunk = ScheduledChunk(self.name, tuple(new), self.computed, blocks, True)
        self.computed = len(self.tokens)
        return chunk


def _steps(vocab: int) -> Iterator[list[Seq]]:
    """Three prompts prefilled together, then decode steps (crossing block ends) of all
    three (10), two (10) and one (6): the batches the stack takes (3, 2, 1) after one it
    does not."""
    ids = itertools.cycle(range(3, vocab))
    a = Seq("a", [next(ids) for _ in range(21)], 0)
    b = Seq("b", [next(ids) for _ in range(9)], 8)
    c = Seq("c", [next(ids) for _ in range(14)], 12)
    yield [a, b, c]
    for step in range(26):
        live = [a, b, c] if step < 10 else [a, b] if step < 20 else [a]
        for seq in live:
            seq.tokens.append(next(ids))
        yield live


def _run(runner: ModelRunner, steps: Iterator[list[Seq]]) -> list[torch.Tensor]:
    out = []
    for live in steps:
        chunks = [s.chunk() for s in live]
        decodes = [c for c in chunks if c.is_decode]
        out.append(runner.execute(decodes + [c for c in chunks if not c.is_decode]))
    return out


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _assert_stack_matches_per_layer(config: EngineConfig, steps: Callable[[], Iterator[list[Seq]]],
                                    monkeypatch: pytest.MonkeyPatch, step_rows: list[int],
                                    kernel: str = "onednn_gemv", blocks: int = 24) -> None:
    """Run ``steps()`` layer by layer (the stack switched off), then again with the stack:
    the same logits at every step and the same KV cache, to the bit."""
    with monkeypatch.context() as off:
        off.setenv(decoder_stack.ENV, "0")
        layered = _runner(config, kernel, blocks)
        reference = _run(layered, steps())
    assert step_rows == []
    stacked = _runner(config, kernel, blocks)
    got = _run(stacked, steps())
    for step, (x, y) in enumerate(zip(got, reference, strict=True)):
        assert torch.equal(x, y), f"step {step}: {(x - y).abs().max()}"
    assert torch.equal(stacked.kv_cache, layered.kv_cache)


@pytest.mark.parametrize("case", list(ARCHS))
def test_the_stack_gives_the_per_layer_forwards_logits_and_cache_to_the_bit(
        model_factory: Callable[..., Path], case: str, step_rows: list[int], threads: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    arch, overrides = ARCHS[case]
    config = _config(model_factory(arch, **overrides))
    _assert_stack_matches_per_layer(config, lambda: _steps(config.model.vocab_size),
                                    monkeypatch, step_rows)
    # Qwen3's per-head q/k norms: one token at a time (see CompiledDecoderStack.max_rows)
    assert step_rows == ([1] * 6 if arch == "qwen3" else [3] * 10 + [2] * 10 + [1] * 6)


# decode batches of the many-sequence run: past the GEMV's rows, across the packed GEMM's
# row blocks (14 rows on AVX-512), down to the GEMV's
MANY = [32] * 3 + [29] * 2 + [15] * 2 + [14] * 2 + [4] * 2 + [3, 1]


def _many_steps(vocab: int) -> Iterator[list[Seq]]:
    """32 prompts (5 to 36 tokens, 4 blocks each) prefilled together, then the decode
    batches of ``MANY`` (the first sequences stay)."""
    ids = itertools.cycle(range(3, vocab))
    seqs = [Seq(f"s{i}", [next(ids) for _ in range(5 + i)], 4 * i) for i in range(MANY[0])]
    yield seqs
    for batch in MANY:
        for seq in seqs[:batch]:
            seq.tokens.append(next(ids))
        yield seqs[:batch]


@pytest.mark.parametrize("kernel", ["packed", "packed_gemm"])
@pytest.mark.parametrize("case", [c for c in ARCHS if ARCHS[c][0] != "qwen3"])
def test_on_the_packed_kernel_the_stack_takes_every_decode_batch_to_the_bit(
        model_factory: Callable[..., Path], case: str, kernel: str, step_rows: list[int],
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``packed_gemm`` (a speculating engine's): the stack's GEMM takes the batches of 1
    and 3 too, as the per-layer forward's does (the GEMV's sums would differ in the last
    bits)."""
    arch, overrides = ARCHS[case]
    config = _config(model_factory(arch, **overrides))
    _assert_stack_matches_per_layer(config, lambda: _many_steps(config.model.vocab_size),
                                    monkeypatch, step_rows, kernel, 4 * MANY[0])
    assert step_rows == MANY


@pytest.mark.parametrize("kernel", ["int8_packed", "int8_packed_gemm"])
@pytest.mark.parametrize("case", ["llama", "odd-widths"])
def test_on_int8_weights_the_stack_takes_every_decode_batch_to_the_bit(
        model_factory: Callable[..., Path], case: str, kernel: str, step_rows: list[int],
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``int8_packed`` (``quantization="int8"``): the stack's int8 GEMV and GEMM are the
    per-layer forward's, at every batch; ``int8_packed_gemm``'s GEMM at every batch."""
    arch, overrides = ARCHS[case]
    config = _config(model_factory(arch, **overrides))
    _assert_stack_matches_per_layer(config, lambda: _many_steps(config.model.vocab_size),
                                    monkeypatch, step_rows, kernel, 4 * MANY[0])
    assert step_rows == MANY


def test_a_plan_mixing_packed_and_packed_gemm_keeps_the_per_layer_forward(
        llama_dir: Path) -> None:
    """The stack hands every weight of a layer to the GEMV, or none."""
    config = _config(llama_dir)
    shapes = sorted({(s.out_features, s.in_features) for s in linear_shapes(config)})
    plan = KernelPlan(tuple((o, i, "packed_gemm" if (o, i) == shapes[0] else "packed")
                            for o, i in shapes), "config")
    runner = ModelRunner(config, Group.single(), 4 * MANY[0], plan)
    assert decoder_stack.CompiledDecoderStack.build(runner.model) is None


@pytest.mark.parametrize(("case", "kv_cache_dtype"), [
    ("llama", "int8"), ("wide-heads", "int8"), ("llama", "fp8_e4m3"), ("wide-heads", "fp8_e5m2")])
def test_over_a_quantised_kv_cache_the_stack_takes_every_decode_batch_to_the_bit(
        model_factory: Callable[..., Path], case: str, kv_cache_dtype: str, step_rows: list[int],
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_cache_dtype="int8"`` or fp8: the stack's quantising KV write and its attention
    over the cache's bytes are the per-layer forward's (the same bytes in the cache, the
    same logits), at every batch."""
    arch, overrides = ARCHS[case]
    config = replace(_config(model_factory(arch, **overrides)),
                     cache=CacheConfig(kv_cache_dtype=kv_cache_dtype))
    _assert_stack_matches_per_layer(config, lambda: _many_steps(config.model.vocab_size),
                                    monkeypatch, step_rows, "packed", 4 * MANY[0])
    assert step_rows == MANY


def test_growing_batches_grow_the_stacks_work_space_and_stop_at_its_most_rows(
        model_factory: Callable[..., Path], step_rows: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches 1, 3, 4, 9, 40, STACK_MAX_ROWS and one more, in that order (the work space
    made for 3 rows, then grown), to the bit against the per-layer forward; the last one
    goes to the per-layer forward."""
    config = _config(model_factory("llama"))
    batches = [1, 3, 4, 9, 40, STACK_MAX_ROWS, STACK_MAX_ROWS + 1]
    vocab = config.model.vocab_size

    def steps() -> Iterator[list[Seq]]:
        ids = itertools.cycle(range(3, vocab))
        seqs = [Seq(f"s{i}", [next(ids), next(ids)], i) for i in range(batches[-1])]
        yield seqs
        for batch in batches:
            for seq in seqs[:batch]:
                seq.tokens.append(next(ids))
            yield seqs[:batch]

    _assert_stack_matches_per_layer(config, steps, monkeypatch, step_rows, "packed",
                                    batches[-1] + 1)
    assert step_rows == batches[:-1]


def test_qwen3_on_the_packed_kernel_stacks_one_token_only(
        model_factory: Callable[..., Path], step_rows: list[int]) -> None:
    config = _config(model_factory("qwen3"))
    runner = _runner(config, "packed", blocks=4 * MANY[0])
    _run(runner, _many_steps(config.model.vocab_size))
    assert step_rows == [1]


def test_a_plan_mixing_packed_and_onednn_gemv_stops_the_stack_at_the_gemvs_rows(
        llama_dir: Path, step_rows: list[int]) -> None:
    config = _config(llama_dir)
    shapes = sorted({(s.out_features, s.in_features) for s in linear_shapes(config)})
    plan = KernelPlan(tuple((o, i, "onednn_gemv" if (o, i) == shapes[0] else "packed")
                            for o, i in shapes), "config")
    runner = ModelRunner(config, Group.single(), 4 * MANY[0], plan)
    stack = decoder_stack.CompiledDecoderStack.build(runner.model)
    assert stack is not None and stack.max_rows == GEMV_MAX_ROWS
    _run(runner, _many_steps(config.model.vocab_size))
    assert step_rows == [3, 1]
    packed = _runner(config, "packed")
    stack = decoder_stack.CompiledDecoderStack.build(packed.model)
    assert stack is not None and stack.max_rows == STACK_MAX_ROWS


def test_steps_the_stack_does_not_take_run_the_per_layer_forward(
        llama_dir: Path, step_rows: list[int]) -> None:
    config = _config(llama_dir)
    runner = _runner(config)
    seqs = [Seq(f"s{i}", [5 + i, 6, 7], 4 * i) for i in range(GEMV_MAX_ROWS + 1)]
    _run(runner, iter([seqs]))  # a prefill
    for seq in seqs:
        seq.tokens.append(9)
    _run(runner, iter([seqs]))  # one decode more than the GEMV's rows
    assert step_rows == []
    seqs[0].tokens.append(10)
    late = Seq("late", [11, 12], 17)
    _run(runner, iter([[seqs[0], late]]))  # a decode with a prefill
    _run(runner, iter([[Seq("short", [15, 16], 19)]]))  # a prefill of two tokens
    seqs[2].tokens.append(17)
    partial = ScheduledChunk("part", (18,), 0, (21,), False)  # a chunk that samples nothing
    runner.execute([seqs[2].chunk(), partial])  # two tokens, one of them not a decode
    assert step_rows == []
    seqs[0].tokens.append(13)
    chunk = seqs[0].chunk()
    token_ids, positions, meta, _ = runner._prepare([chunk])
    layers: list[int] = []
    with torch.inference_mode(), forward_context(ForwardContext(meta, layers.append)):
        runner.model(token_ids, positions)  # a layer hook must see every layer
    assert layers == list(range(config.model.num_layers)) and step_rows == []
    seqs[1].tokens.append(14)
    _run(runner, iter([[seqs[1]]]))
    assert step_rows == [1]


def test_linears_on_another_kernel_keep_the_per_layer_forward(llama_dir: Path,
                                                              step_rows: list[int]) -> None:
    """The measured plan chose oneDNN's GEMM even at batch 1: the stack is not used."""
    runner = _runner(_config(llama_dir), kernel="onednn")
    _run(runner, _steps(runner.config.model.vocab_size))
    assert step_rows == []


def test_a_new_plan_or_cache_is_followed(llama_dir: Path, step_rows: list[int]) -> None:
    config = _config(llama_dir)
    runner = _runner(config)
    steps = _steps(config.model.vocab_size)
    _run(runner, itertools.islice(steps, 2))
    assert step_rows == [3]
    apply_kernel_plan(runner.model, _plan(config, "onednn"))
    _run(runner, itertools.islice(steps, 1))
    assert step_rows == [3]
    apply_kernel_plan(runner.model, _plan(config, "onednn_gemv"))
    _run(runner, itertools.islice(steps, 1))
    assert step_rows == [3, 3]
    # a new cache (a copy of the old): the next step writes into it, the old stays as it was
    old = runner.kv_cache
    runner.kv_cache = old.clone()
    runner.model.set_kv_cache(runner.kv_cache)
    before = old.clone()
    _run(runner, itertools.islice(steps, 1))
    assert step_rows == [3, 3, 3]
    assert torch.equal(old, before) and not torch.equal(runner.kv_cache, old)


def _rows(runner: ModelRunner, rows: int) -> dict[str, Any]:
    """Inputs for ``rows`` well-formed decode rows (row i: slot 3 of block i)."""
    cfg = runner.config.model
    return {"h": torch.randn(rows, cfg.hidden_size), "cos": torch.ones(rows, 1, cfg.head_dim),
            "sin": torch.zeros(rows, 1, cfg.head_dim),
            "slot_mapping": torch.tensor([BLOCK * i + 3 for i in range(rows)]),
            "block_tables": torch.tensor([[i] for i in range(rows)]),
            "context_lens": torch.tensor([4] * rows)}


def _stack_inputs(runner: ModelRunner, **changes: Any) -> dict[str, Any]:
    """Two well-formed decode rows (slot 3 of blocks 0 and 1), then ``changes``."""
    return {**_rows(runner, 2), **changes}


def test_slots_lengths_and_blocks_are_checked_before_anything_is_written(
        llama_dir: Path, kernels: NativeKernels) -> None:
    runner = _runner(_config(llama_dir))
    stack = decoder_stack.CompiledDecoderStack.build(runner.model)
    assert stack is not None
    layers = stack._layers
    before = runner.kv_cache.clone()
    slots = runner.num_kv_blocks * BLOCK
    # the second row is the bad one: the first, well formed, must not be written either
    for changes, error, words in (
            ({"slot_mapping": torch.tensor([3, slots])}, IndexError, "slot"),
            ({"slot_mapping": torch.tensor([3, -1])}, IndexError, "slot"),
            ({"block_tables": torch.tensor([[0], [runner.num_kv_blocks]])}, IndexError,
             "block id"),
            ({"context_lens": torch.tensor([4, BLOCK + 1])}, ValueError, "context length"),
            ({"context_lens": torch.tensor([4, 0])}, ValueError, "context length"),
            ({"slot_mapping": torch.tensor([3, 21], dtype=torch.int32)}, ValueError,
             "does not take"),
            ({"h": torch.randn(2, 8)}, ValueError, "does not take"),
            (_rows(runner, GEMV_MAX_ROWS + 1), ValueError, "does not take")):  # past the GEMV
        inputs = _stack_inputs(runner, **changes)
        h = inputs["h"].clone()
        with pytest.raises(error, match=words):
            kernels.decoder_stack(layers, **inputs)
        assert torch.equal(inputs["h"], h)
    assert torch.equal(runner.kv_cache, before)
    inputs = _stack_inputs(runner)  # the same, well formed
    h = inputs["h"].clone()
    kernels.decoder_stack(layers, **inputs)
    assert not torch.equal(runner.kv_cache, before) and not torch.equal(inputs["h"], h)


def _step_inputs(runner: ModelRunner, **changes: Any) -> dict[str, Any]:
    """``decoder_step``'s two well-formed decode rows (tokens 5 and 6 at position 3, slot 3
    of blocks 0 and 1), then ``changes``."""
    rows = _rows(runner, 2)
    return {"token_ids": torch.tensor([5, 6]), "positions": torch.tensor([3, 3]),
            **{k: rows[k] for k in ("slot_mapping", "block_tables", "context_lens")},
            **changes}


def test_the_step_is_the_embedding_the_stack_and_the_final_norm_to_the_bit(
        llama_dir: Path, kernels: NativeKernels) -> None:
    """``decoder_step`` against the same step from torch's embedding and RoPE lookup,
    ``decoder_stack`` and the model's final norm, on the same cache."""
    runner = _runner(_config(llama_dir))
    model = runner.model
    stack = decoder_stack.CompiledDecoderStack.build(model)
    assert stack is not None
    start = runner.kv_cache.clone()
    inputs = _step_inputs(runner)
    out = kernels.decoder_step(stack._layers, **inputs)
    after_step = runner.kv_cache.clone()
    runner.kv_cache.copy_(start)
    h = model.embed_tokens(inputs["token_ids"])
    cos, sin = model.rotary.cos_sin(inputs["positions"], torch.float32)
    kernels.decoder_stack(stack._layers, h, cos, sin, inputs["slot_mapping"],
                          inputs["block_tables"], inputs["context_lens"])
    assert torch.equal(out, model.norm(h))
    assert torch.equal(runner.kv_cache, after_step) and not torch.equal(after_step, start)


def test_token_ids_and_positions_are_checked_before_anything_is_written(
        llama_dir: Path, kernels: NativeKernels) -> None:
    runner = _runner(_config(llama_dir))
    stack = decoder_stack.CompiledDecoderStack.build(runner.model)
    assert stack is not None
    vocab, positions = runner.config.model.vocab_size, runner.model.rotary.cos.shape[0]
    before = runner.kv_cache.clone()
    # the second row is the bad one: the first, well formed, must not be written either
    for changes, error, words in (
            ({"token_ids": torch.tensor([5, vocab])}, IndexError, "token id"),
            ({"token_ids": torch.tensor([5, -1])}, IndexError, "token id"),
            ({"positions": torch.tensor([3, positions])}, IndexError, "position"),
            ({"positions": torch.tensor([3, -1])}, IndexError, "position"),
            ({"slot_mapping": torch.tensor([3, runner.num_kv_blocks * BLOCK])}, IndexError,
             "slot"),
            ({"context_lens": torch.tensor([4, BLOCK + 1])}, ValueError, "context length"),
            ({"token_ids": torch.tensor([5, 6], dtype=torch.int32)}, ValueError, "does not take"),
            ({"positions": torch.tensor([3, 3, 3])}, ValueError, "does not take")):
        with pytest.raises(error, match=words):
            kernels.decoder_step(stack._layers, **_step_inputs(runner, **changes))
    assert torch.equal(runner.kv_cache, before)
    layers = stack._layers
    bare = DecoderLayers(layers.shape, layers.layers, kernels.panel_floats)  # no ends
    with pytest.raises(ValueError, match="without ends"):
        kernels.decoder_step(bare, **_step_inputs(runner))
    assert layers.ends is not None
    for change in ({"embed": layers.ends.embed[:, :-1]}, {"rope_cos": layers.ends.rope_sin.T},
                   {"final_norm": layers.ends.final_norm.double()}):
        with pytest.raises(ValueError, match="decoder ends"):
            DecoderLayers(layers.shape, layers.layers, kernels.panel_floats,
                          replace(layers.ends, **change))
    assert torch.equal(runner.kv_cache, before)


def test_inputs_the_step_does_not_take_go_to_the_per_layer_forward(llama_dir: Path) -> None:
    """``takes`` says no (the model then runs layer by layer) where ``decoder_step`` would
    refuse the step's integers: not int64, a strided block table."""
    runner = _runner(_config(llama_dir))
    stack = decoder_stack.CompiledDecoderStack.build(runner.model)
    assert stack is not None
    seqs = [Seq("a", list(range(5, 25)), 0), Seq("b", list(range(7, 27)), 2)]  # 2 blocks each
    _run(runner, iter([seqs]))
    for seq in seqs:
        seq.tokens.append(8)
    token_ids, positions, meta, _ = runner._prepare([seq.chunk() for seq in seqs])
    assert stack.takes(token_ids, positions, meta)
    assert not stack.takes(token_ids.int(), positions, meta)
    assert not stack.takes(token_ids, positions.int(), meta)
    wide = torch.stack([meta.decode_block_tables, meta.decode_block_tables], 2)[..., 0]
    assert not wide.is_contiguous() and torch.equal(wide, meta.decode_block_tables)
    assert not stack.takes(token_ids, positions, replace(meta, decode_block_tables=wide))
    assert not stack.takes(token_ids, positions, replace(meta, slot_mapping=meta.slot_mapping.int()))
    assert not stack.takes(token_ids, positions,
                           replace(meta, decode_context_lens=meta.decode_context_lens.int()))


def test_layers_of_the_wrong_shape_are_refused(llama_dir: Path, kernels: NativeKernels) -> None:
    runner = _runner(_config(llama_dir))
    stack = decoder_stack.CompiledDecoderStack.build(runner.model)
    assert stack is not None
    good = stack._layers.layers[0]
    for change in ({"qkv_w": good.qkv_w[:-1]}, {"o_w": good.o_w.T},
                   {"q_norm": torch.ones(3), "k_norm": torch.ones(3)}, {"k_norm": torch.ones(16)},
                   {"down_w": good.down_w.double()}):
        with pytest.raises(ValueError, match="layer 0"):
            DecoderLayers(stack._layers.shape, [replace(good, **change)])


def test_packed_weights_come_all_four_and_of_their_size(llama_dir: Path,
                                                         kernels: NativeKernels) -> None:
    runner = _runner(_config(llama_dir), "packed")
    stack = decoder_stack.CompiledDecoderStack.build(runner.model)
    assert stack is not None and stack._layers.max_rows == STACK_MAX_ROWS
    good, shape = stack._layers.layers[0], stack._layers.shape
    with pytest.raises(ValueError, match="all four or none"):
        DecoderLayers(shape, [replace(good, o_p=None)], kernels.panel_floats)
    with pytest.raises(ValueError, match="layer 0: down_p"):
        DecoderLayers(shape, [replace(good, down_p=good.down_p[:-1])], kernels.panel_floats)
    with pytest.raises(ValueError, match="layer 0: qkv_p"):  # another weight's panels
        DecoderLayers(shape, [replace(good, qkv_p=good.o_p)], kernels.panel_floats)
    without = DecoderLayers(shape, [replace(good, qkv_p=None, o_p=None, gate_up_p=None,
                                            down_p=None)])
    assert without.max_rows == GEMV_MAX_ROWS
    with pytest.raises(ValueError, match="does not take"):  # past the GEMV without panels
        kernels.decoder_stack(without, **_rows(runner, GEMV_MAX_ROWS + 1))
    with pytest.raises(ValueError, match="without the GEMV it needs its packed weights"):
        DecoderLayers(shape, [replace(good, gemv=False, qkv_p=None, o_p=None,
                                      gate_up_p=None, down_p=None)])


def test_int8_weights_come_with_their_scales_and_int8_panels(llama_dir: Path,
                                                            kernels: NativeKernels) -> None:
    runner = _runner(_config(llama_dir), "int8_packed")
    stack = decoder_stack.CompiledDecoderStack.build(runner.model)
    assert stack is not None and stack._layers.max_rows == STACK_MAX_ROWS
    good, shape = stack._layers.layers[0], stack._layers.shape
    assert good.qkv_w.dtype == torch.int8 and good.qkv_s is not None
    fp32 = _runner(_config(llama_dir), "packed")
    stack32 = decoder_stack.CompiledDecoderStack.build(fp32.model)
    assert stack32 is not None
    fp32_layer = stack32._layers.layers[0]
    for change, name in (({"o_s": None}, "o_w"),  # int8 without its scales
                         ({"o_s": good.o_s[:-1]}, "o_s"),
                         ({"gate_up_s": good.gate_up_s.double()}, "gate_up_s"),  # type: ignore[union-attr]
                         ({"qkv_w": fp32_layer.qkv_w}, "qkv_w"),  # fp32 with int8 scales
                         ({"down_p": fp32_layer.down_p}, "down_p")):  # fp32 panels
        with pytest.raises(ValueError, match=f"layer 0: {name}"):
            DecoderLayers(shape, [replace(good, **change)], kernels.panel_floats)


def test_a_model_off_the_compiled_backend_never_loads_the_kernels_for_it(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, or in bf16, the model has another attention backend: asking whether the
    stack applies must not build the compiled library."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models import build_model

    def refuse() -> None:
        raise AssertionError("the compiled kernels were asked for")

    monkeypatch.setattr(decoder_stack, "native", refuse)
    model = build_model(_config(llama_dir).model, Group.single(), TorchAttentionBackend())
    assert decoder_stack.CompiledDecoderStack.build(model) is None


def test_a_model_is_built_in_its_dtype(llama_dir: Path) -> None:
    """Parameters made in the model's dtype from the start (built in float32 and
    converted, a bfloat16 model took twice its bytes at its peak); torch's default dtype
    is as it was after."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models import build_model

    config = load_model_config(llama_dir, dtype="bfloat16")
    model = build_model(config, Group.single(), TorchAttentionBackend())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
