"""Speculative decoding with a draft model (``engine.core.drafter``), through the real
engine: greedy and seeded output equal to decoding without it on every architecture, in
mixed batches, under preemption, over an int8 KV cache and at TP 2. A draft that is the
target itself has every greedy guess kept — which it only can if the draft's KV (caught
up per request, recomputed after preemption, shared through cached blocks) is right; a
draft of other weights has its guesses rejected and changes no token. Bad drafts are
refused naming why; an abort mid-speculation frees every block."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    load_model_config,
)
from engine.core.drafter import CATCH_UP_TOKENS
from engine.core.engine_core import EngineCore
from engine.core.scheduler import ScheduledChunk
from engine.kernels.cpu import NativeKernels
from tests.engine.core.test_speculative import (
    GREEDY,
    MIXED_ENGINE,
    NGRAM,
    _mixed,
    same_tokens,
)
from tests.engine.kernels.test_int8 import ARCHS

Factory = Callable[..., Path]


def draft(model_dir: Path, k: int = 4) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def other_draft(model_factory: Factory, arch: str = "llama") -> Path:
    """A one-layer draft of other random weights (the same tokenizer and vocabulary)."""
    return model_factory(arch, seed=1, num_hidden_layers=1)


def test_a_draft_it_cannot_use_is_refused(model_factory: Factory, llama_dir: Path,
                                          tmp_path: Path) -> None:
    for bad, match in (({"method": "draft_model", "num_speculative_tokens": 2}, "needs"),
                       ({**draft(llama_dir), "prompt_lookup_max": 2}, "n-gram"),
                       ({"method": "ngram", "model": str(llama_dir),
                         "num_speculative_tokens": 2}, "only it"),
                       ({**draft(llama_dir), "model": 3}, "directory"),
                       ({**draft(llama_dir), "quantization": "fp4"}, "quantization"),
                       ({**NGRAM, "quantization": "int8"}, "quantization"),
                       (draft(tmp_path), "missing config.json"),
                       (draft(model_factory("llama", vocab_size=1024)), "vocabulary"),
                       (draft(model_factory("llama", max_position_embeddings=64)),
                        "positions")):
        with pytest.raises(ConfigError, match=match):
            LLM(llama_dir, speculative_config=bad)


def test_a_pool_sized_to_memory_holds_the_drafts_kv_within_the_same_budget(
        model_factory: Factory, llama_dir: Path) -> None:
    budget = 1 << 20  # bytes for the KV (max_kv_bytes on CPU)

    def core(**speculative: Any) -> EngineCore:
        return EngineCore(EngineConfig(
            model=load_model_config(llama_dir), cache=CacheConfig(max_kv_bytes=budget),
            scheduler=SchedulerConfig(max_num_seqs=4096, **speculative)))

    alone = core()
    try:
        drafting = core(speculative_method="draft_model", num_speculative_tokens=2,
                        speculative_model=str(other_draft(model_factory)))
    except BaseException:
        alone.shutdown()
        raise
    try:
        assert drafting.drafter is not None
        target_kv = drafting.executor.runner.kv_cache  # type: ignore[attr-defined]
        draft_kv = drafting.drafter.runner.kv_cache
        per_block = (target_kv.nbytes + draft_kv.nbytes) // drafting.executor.num_kv_blocks
        assert target_kv.nbytes + draft_kv.nbytes <= budget < (
            target_kv.nbytes + draft_kv.nbytes + per_block)
        assert drafting.executor.num_kv_blocks < alone.executor.num_kv_blocks
    finally:
        alone.shutdown()
        drafting.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_draft_model_changes_no_greedy_or_seeded_token(model_factory: Factory,
                                                        arch: str) -> None:
    model_dir = model_factory(arch)
    prompts, params = _mixed(model_dir)
    # the target as its own draft: its greedy guesses are kept (the seeded request's are
    # drawn at temperature 0.9, so many are not)
    for drafter, kept in ((model_dir, 0.3), (other_draft(model_factory, arch), None)):
        stats = same_tokens(model_dir, prompts, params, draft(drafter), **MIXED_ENGINE)
        assert stats.num_draft_tokens > 0
        if kept is not None:
            assert stats.num_accepted_tokens >= kept * stats.num_draft_tokens


def test_every_greedy_guess_of_the_target_as_its_own_draft_is_kept(llama_dir: Path) -> None:
    """Greedy requests only, prompts sharing cached blocks (the second request's draft KV
    in them is the first's) and a second round served from the prefix cache."""
    base = [5, 6, 7, 8, 9, 10, 11, 12] * 6
    prompts = [base, base + [40, 41], list(range(60, 110))]
    with LLM(llama_dir) as plain:
        expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    with LLM(llama_dir, speculative_config=draft(llama_dir)) as spec:
        for _ in range(2):
            results = spec.generate(prompts, GREEDY)
            assert [r.token_ids for r in results] == expected
        assert results[0].num_cached_tokens >= 32
        stats = spec.stats
    assert stats.num_draft_tokens > 200
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens


def test_short_catch_ups_run_as_decode_rows_and_write_the_right_draft_kv(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch, kernels: NativeKernels) -> None:
    """After a step whose guesses were all kept, the draft catches up its last guess and
    the target's next token: two tokens, run as decode rows, which the draft's compiled
    stack takes (its weights on a kernel with panels, here forced), and in a step beside a
    long prompt's chunk (chunked prefill: 64 tokens a step) run beside the draft's KV of
    that chunk, a prefill chunk, in one forward. The target as its own draft still has
    every greedy guess kept, which it only can if those rows wrote the right KV and the
    last row's logits gave the guess."""
    prompts = [[5, 6, 7, 8] * 5, list(range(3, 203))]
    with LLM(llama_dir, max_num_batched_tokens=64) as plain:
        expected = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    stacked: list[tuple[int, int]] = []  # (id of the layers, rows) of each compiled step
    real = NativeKernels.decoder_step

    def counted(self: NativeKernels, layers: Any, token_ids: Any, *args: Any) -> Any:
        stacked.append((id(layers), token_ids.shape[0]))
        return real(self, layers, token_ids, *args)

    monkeypatch.setattr(NativeKernels, "decoder_step", counted)
    with LLM(llama_dir, speculative_config=draft(llama_dir), linear_kernel="packed_gemm",
             max_num_batched_tokens=64) as spec:
        runner = spec.core.drafter.runner
        calls: list[list[ScheduledChunk]] = []
        execute = runner.execute

        def spy(chunks: list[ScheduledChunk], *args: Any) -> Any:
            calls.append(list(chunks))
            return execute(chunks, *args)

        monkeypatch.setattr(runner, "execute", spy)
        assert [r.token_ids for r in spec.generate(prompts, GREEDY)] == expected
        stats = spec.stats
        draft_stack = runner.model._stack
        assert draft_stack is not None
        draft_layers = id(draft_stack._layers)
    rows = [c for call in calls for c in call if c.num_draft_tokens]
    assert rows and all(c.sample and c.num_draft_tokens == len(c.token_ids) - 1 <= 7
                        for c in rows)
    assert any(any(c.num_draft_tokens for c in call)
               and any(len(c.token_ids) > 8 and not c.num_draft_tokens for c in call)
               for call in calls)  # rows beside a prompt's chunk, in one forward
    assert any(layers == draft_layers and n >= 2 for layers, n in stacked)
    assert stats.num_accepted_tokens >= 0.97 * stats.num_draft_tokens > 100


def test_under_preemption_the_draft_starts_again_and_no_token_changes(llama_dir: Path) -> None:
    """16 blocks of 16 for two 150-token sequences: one is preempted and recomputed; its
    draft KV starts again from what its blocks hold (``DraftBlocks``: nothing, or what
    the prefix cache kept)."""
    prompts = [list(range(3, 40)) * 2, list(range(50, 80)) * 2]
    params = SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True)
    stats = same_tokens(llama_dir, prompts, params, draft(llama_dir), num_kv_blocks=16,
                        max_num_batched_tokens=32)
    assert stats.num_preemptions > 0
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0


def test_over_an_int8_cache_at_tp_2_and_as_int8_weights_a_draft_changes_no_token(
        model_factory: Factory, llama_dir: Path) -> None:
    prompts = [[5, 6, 7, 8] * 12, list(range(3, 60)) * 2]
    spec_config = draft(other_draft(model_factory), k=3)
    assert same_tokens(llama_dir, prompts, GREEDY, spec_config,
                       kv_cache_dtype="int8").num_draft_tokens > 0
    assert same_tokens(llama_dir, prompts, GREEDY, spec_config, plain={},
                       tensor_parallel_size=2).num_draft_tokens > 0
    # the draft's own weights in int8 (speculative_config's quantization): the target as
    # its own draft, rounded (random weights' near-ties flip, so only some guesses hold)
    quantized = {**draft(llama_dir), "quantization": "int8"}
    stats = same_tokens(llama_dir, prompts, GREEDY, quantized)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_seeded_sampling_at_temperature_1_is_unchanged_for_every_seed(llama_dir: Path) -> None:
    prompt = [5, 6, 7, 8] * 12
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(16)]
    stats = same_tokens(llama_dir, [prompt] * 16, params, draft(llama_dir))
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_an_abort_mid_speculation_frees_every_block(llama_dir: Path) -> None:
    with LLM(llama_dir) as engine:
        config = dataclasses.replace(
            engine.config, scheduler=dataclasses.replace(
                engine.config.scheduler, speculative_method="draft_model",
                num_speculative_tokens=4, prompt_lookup_max=4,
                speculative_model=str(llama_dir)))
        core = EngineCore(config, engine.tokenizer)
        try:
            for i in range(3):
                core.add_request(f"r{i}", [20 + i, 21, 22, 23] * 10, GREEDY)
            for _ in range(20):  # steps until one guesses; it is aborted in flight
                out = core.scheduler.schedule()
                sampled = core._execute(out)
                if any(c.num_draft_tokens for c in out.chunks):
                    break
                core.scheduler.update(out, sampled)
            assert any(c.num_draft_tokens for c in out.chunks)
            for i in range(3):
                assert core.abort_request(f"r{i}")
            core.scheduler.update(out, sampled)
            core.check_integrity()
            assert core.kv_usage().in_use == 0 and not core.has_unfinished()
        finally:
            core.shutdown()


def _forwards(core: EngineCore) -> list[list[ScheduledChunk]]:
    """The chunks of every forward ``core``'s draft makes from now on (appended as it
    makes them)."""
    assert core.drafter is not None
    runner = core.drafter.runner
    forwards: list[list[ScheduledChunk]] = []
    execute = runner.execute

    def spy(chunks: list[ScheduledChunk], *args: Any) -> Any:
        forwards.append(list(chunks))
        return execute(chunks, *args)

    runner.execute = spy  # type: ignore[method-assign]
    return forwards


def test_a_prompt_prefilled_here_or_found_cached_guesses_at_its_first_decode_step(
        llama_dir: Path) -> None:
    """The draft computes a prompt's KV in the step that prefills it (its chunk beside the
    target's), so the first decode step guesses; the same prompt again finds its blocks in
    the prefix cache, and the draft's KV in them (``DraftBlocks``): it computes only the
    uncached rest, and guesses at once too. The target as its own draft has every greedy
    guess kept, which it only can if that KV is right; the tokens are the plain ones."""
    prompt = list(range(3, 203))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as plain:
        expected = plain.generate([prompt], params)[0].token_ids
    with LLM(llama_dir, speculative_config=draft(llama_dir)) as llm:
        core = llm.core
        drafted = _forwards(core)
        for rid in ("first", "again"):
            drafted.clear()
            core.add_request(rid, prompt, params)
            guessed, tokens = _run(core)
            assert guessed[0] == 0 and guessed[1] > 0, rid  # the prefill, then guesses
            assert tokens == expected, rid
            prompt_chunks = [c for c in drafted[0] if not c.sample]
            assert [(c.start_position, len(c.token_ids)) for c in prompt_chunks] == (
                [(0, 200)] if rid == "first" else [(192, 8)])  # 12 blocks found cached
        stats = llm.stats
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0


def test_no_draft_kv_is_computed_for_a_prompt_that_never_guesses(llama_dir: Path) -> None:
    """Prompts whose requests cannot guess (a ``max_tokens`` of 2: no room after the first
    token; logprobs asked for: such requests never speculate) get no draft chunk beside
    their prefill; one that may guess does."""
    prompt = list(range(3, 43))
    with LLM(llama_dir, speculative_config=draft(llama_dir)) as llm:
        core = llm.core
        drafted = _forwards(core)
        for rid, params in (("short", SamplingParams(max_tokens=2, temperature=0.0)),
                            ("logprobs", SamplingParams(max_tokens=8, temperature=0.0,
                                                        logprobs=2)),
                            ("guesses", SamplingParams(max_tokens=8, temperature=0.0))):
            drafted.clear()
            core.add_request(rid, prompt, params)
            out = core.scheduler.schedule()
            assert [c.request_id for c in out.prefills] == [rid]
            core.scheduler.update(out, core._execute(out))
            assert drafted == ([] if rid != "guesses" else [[ScheduledChunk(
                rid, tuple(prompt), 0, out.prefills[0].block_ids, sample=False)]]), rid
            core.abort_request(rid)


def _admitted_with_kv_from(prefill: LLM, core: EngineCore, prompt: list[int],
                           params: SamplingParams) -> tuple[list[int], list[int]]:
    """Request "r"'s prompt prefilled by ``prefill`` (prefill only), its KV copied into
    the blocks ``core`` reserved, admitted there (as a prefill worker's KV arrives):
    its block ids on ``core`` and its first token."""
    prefill.core.add_request("r", prompt, params, prefill_only=True)
    while not (done := prefill.core.step()):
        pass
    reserved = core.reserve_for_kv("r", prompt, params)
    assert reserved is not None
    core.executor.runner.kv_cache[:, :, reserved.block_ids] = (
        prefill.core.executor.runner.kv_cache[:, :, list(done[0].block_ids)])
    assert prefill.core.release_pinned("r")
    first = core.admit_with_kv("r", done[0].new_token_ids[0])
    return list(reserved.block_ids), list(first.new_token_ids)


def _run(core: EngineCore) -> tuple[list[int], list[int]]:
    """Step ``core`` until done: the guesses each step computed, the tokens sampled."""
    guessed, tokens = [], []
    while core.has_unfinished():
        out = core.scheduler.schedule()
        sampled = core._execute(out)  # the draft fills (or withdraws) the guesses here
        guessed.append(sum(c.num_draft_tokens for c in out.chunks))
        tokens += [u.new_token_id for u in core.scheduler.update(out, sampled)]
        core.drafter.settle(out, core.scheduler.requests)  # as EngineCore.step does
    return guessed, tokens


def test_a_long_prompts_draft_kv_is_caught_up_a_chunk_a_step(llama_dir: Path) -> None:
    """A 200-token prompt whose KV was prefilled by another engine (as a prefill worker's
    arrives): its draft KV is computed ``CATCH_UP_TOKENS`` a step (no guesses meanwhile:
    each of those steps stays short for the other streams), then every greedy guess of
    the target as its own draft is kept; the tokens are the plain ones."""
    prompt = list(range(3, 203))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as prefill, LLM(llama_dir, max_num_batched_tokens=256,
                                         speculative_config=draft(llama_dir)) as llm:
        expected = prefill.generate([prompt], params)[0].token_ids
        _, first = _admitted_with_kv_from(prefill, llm.core, prompt, params)
        guessed, tokens = _run(llm.core)
        stats = llm.stats
    catching_up = -(-len(prompt) // CATCH_UP_TOKENS) - 1  # steps before the last chunk
    assert guessed[:catching_up] == [0] * catching_up
    assert guessed[catching_up] > 0
    assert first + tokens == expected
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0


def test_a_request_whose_draft_kv_was_written_elsewhere_guesses_at_once(
        llama_dir: Path) -> None:
    """``DraftModel.written``: a prompt's KV from another engine, its draft KV computed
    outside the drafter (as a prefill worker's would be) and declared: the first decode
    step guesses, with no catch-up steps, and the guesses of the target as its own draft
    are kept (the KV is right); the tokens are the plain ones."""
    prompt = list(range(3, 203))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir) as prefill, LLM(llama_dir, speculative_config=draft(llama_dir)) as llm:
        expected = prefill.generate([prompt], params)[0].token_ids
        core = llm.core
        blocks, first = _admitted_with_kv_from(prefill, core, prompt, params)
        core.drafter.runner.execute([ScheduledChunk("r", tuple(prompt), 0, tuple(blocks),
                                                    sample=False)])
        core.drafter.written(core.scheduler.requests["r"], len(prompt), blocks)
        guessed, tokens = _run(core)
        stats = llm.stats
    assert guessed[0] > 0  # the first decode step guesses
    assert first + tokens == expected
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0


def test_requests_catching_up_by_different_lengths_get_right_draft_kv(llama_dir: Path) -> None:
    """A greedy request beside seeded ones (whose guesses are often rejected, so the
    draft's chunks in one step have different lengths): the greedy request's guesses,
    the target being its own draft, are all kept, and the draft's cache holds no NaN."""
    prompts = [[5, 6, 7, 8] * 12, [9, 10, 11] * 12, [20, 21] * 30]
    params = [GREEDY] + [SamplingParams(max_tokens=96, temperature=1.0, seed=s,
                                        ignore_eos=True) for s in (1, 2)]
    with LLM(llama_dir, speculative_config=draft(llama_dir)) as llm:
        core = llm.core
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(f"r{i}", prompt, p)
        guessed = kept = 0
        while core.has_unfinished():
            out = core.scheduler.schedule()
            sampled = core._execute(out)
            updates = core.scheduler.update(out, sampled)
            core.drafter.settle(out, core.scheduler.requests)
            for chunk in out.chunks:
                if chunk.request_id == "r0" and chunk.num_draft_tokens:
                    guessed += chunk.num_draft_tokens
                    kept += sum(u.request.request_id == "r0" for u in updates) - 1
        assert not core.drafter.runner.kv_cache.isnan().any()
    assert guessed > 40 and kept >= 0.95 * guessed


def test_a_kernel_the_environment_forces_for_the_target_leaves_a_draft_quantised_otherwise(
        llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PDSERVE_LINEAR_KERNEL=int8_torch with int8 target weights and a draft in float32:
    the draft's kernel is chosen as without it (it refused to start, the forced kernel
    not multiplying the draft's weights); the target's is the one forced."""
    monkeypatch.setenv("PDSERVE_LINEAR_KERNEL", "int8_torch")
    with LLM(llama_dir, num_kv_blocks=64, quantization="int8",
             speculative_config=draft(llama_dir, k=2)) as llm:
        [out] = llm.generate([[5, 6, 7, 8] * 4], GREEDY)
        assert len(out.token_ids) == GREEDY.max_tokens
        assert llm.core.executor.runner.linear_kernel == "int8_torch"
