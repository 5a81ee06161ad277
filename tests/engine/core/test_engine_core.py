"""EngineCore lifecycles through the real model: continuous batching, chunked prefill,
prefill-only requests with pinned blocks, KV written from outside, layer hooks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.kv_quant import dequantize, quantize
from engine.core.engine_core import EngineCore
from tests.factories import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    with LLM(llama_dir, num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=64) as engine:
        yield engine


def _drain(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_requests_join_while_others_decode(llm: LLM, llama_dir: Path) -> None:
    # 1. eight prompts, at most four running: the others must join mid-decode
    before = llm.stats.num_admissions_during_decode
    results = llm.generate(PROMPTS[:8], GREEDY)
    assert llm.stats.num_admissions_during_decode > before
    # 2. same tokens as running each prompt alone
    with LLM(llama_dir, num_kv_blocks=128, max_num_seqs=1) as solo:
        for prompt, res in zip(PROMPTS[:8], results, strict=True):
            assert solo.generate([prompt], GREEDY)[0].token_ids == res.token_ids
    llm.core.check_integrity()


def test_long_prompt_is_prefilled_in_chunks(llm: LLM) -> None:
    core = llm.core
    prompt = list(range(3, 3 + 150))  # 150 tokens, budget 64 per step
    core.add_request("long", prompt, GREEDY)
    chunk_sizes = []
    while core.has_unfinished():
        out = core.scheduler.schedule()
        chunk_sizes += [len(c.token_ids) for c in out.prefills if c.request_id == "long"]
        sampled = core._execute(out)
        core.scheduler.update(out, sampled)
    assert chunk_sizes == [64, 64, 22]
    with LLM(llm.config.model.model_dir, num_kv_blocks=128, max_num_batched_tokens=512,
             enable_prefix_caching=False) as whole:
        ref = whole.generate([prompt], GREEDY)[0].token_ids
    assert core.scheduler.requests["long"].output_token_ids == ref
    core.abort_request("long")  # finished already: drops what the bypassed output path kept


def test_prefill_only_pins_blocks_until_released(llm: LLM) -> None:
    core = llm.core
    prompt = llm.encode(PROMPTS[3])
    core.add_request("p1", prompt, GREEDY, prefill_only=True)
    outs = [o for o in _step_all(core) if o.request_id == "p1"]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "prefilled"
    assert len(outs[0].new_token_ids) == 1
    assert outs[0].block_ids is not None
    assert len(outs[0].block_ids) == -(-len(prompt) // 16)
    assert core.kv_usage().pinned == len(outs[0].block_ids)
    assert core.release_pinned("p1") and not core.release_pinned("p1")
    assert core.kv_usage().pinned == 0
    core.check_integrity()


def _step_all(core: EngineCore) -> list:
    outs = []
    while core.has_unfinished():
        outs += core.step()
    return outs


def test_kv_written_from_outside_continues_like_local(llama_dir: Path) -> None:
    """Prefill on one engine, copy the KV blocks into another engine's reserved blocks,
    admit there: the continuation equals a plain local generation."""
    with LLM(llama_dir, num_kv_blocks=64) as prefill, LLM(llama_dir, num_kv_blocks=64) as decode:
        prompt = prefill.encode(PROMPTS[0])
        expected = prefill.generate([prompt], GREEDY)[0].token_ids
        # 1. prefill-only on the "prefill" engine
        prefill.core.add_request("x", prompt, GREEDY, prefill_only=True)
        (out,) = _step_all(prefill.core)
        src_blocks = list(out.block_ids)
        # 2. reserve on the "decode" engine, copy the KV block by block
        reserved = decode.core.reserve_for_kv("x", prompt, GREEDY)
        assert reserved is not None and reserved.num_cached_blocks == 0
        dst_blocks = reserved.block_ids
        assert len(dst_blocks) == len(src_blocks)
        src_kv = prefill.core.executor.runner.kv_cache
        dst_kv = decode.core.executor.runner.kv_cache
        dst_kv[:, :, dst_blocks] = src_kv[:, :, src_blocks]
        assert prefill.core.release_pinned("x")
        # 3. admit with the first token sampled by the prefill side, then decode
        first = decode.core.admit_with_kv("x", out.new_token_ids[0])
        rest = _drain(decode.core).get("x", [])
        assert first.new_token_ids + rest == expected
        for engine in (prefill, decode):
            engine.core.check_integrity()
            assert engine.core.kv_usage().in_use == 0


def test_reservation_reuses_the_prefix_cache(llama_dir: Path) -> None:
    """A second reservation of a prompt sharing a cached prefix takes those blocks as they
    are (never the last token's block); written only after them, it continues like a
    local generation, and a refused or aborted one leaves the cache intact; with
    ``max_reused_blocks`` it takes no more than that many (what a Prefill sent ahead of the
    Reserve's reply skips)."""
    with LLM(llama_dir, num_kv_blocks=64) as prefill, LLM(llama_dir, num_kv_blocks=64) as decode:
        first = list(range(3, 3 + 40))  # 2 full blocks + 8 tokens
        second = first[:32] + list(range(100, 120))  # shares the 2 full blocks
        src_kv = prefill.core.executor.runner.kv_cache
        dst_kv = decode.core.executor.runner.kv_cache
        for rid, prompt, want_cached in (("a", first, 0), ("b", second, 2), ("c", first[:32], 1)):
            expected = prefill.generate([prompt], GREEDY)[0].token_ids
            prefill.core.add_request(rid, prompt, GREEDY, prefill_only=True)
            (out,) = _step_all(prefill.core)
            reserved = decode.core.reserve_for_kv(rid, prompt, GREEDY, reuse_prefix=True)
            assert reserved is not None and reserved.num_cached_blocks == want_cached
            written = reserved.blocks_to_write
            dst_kv[:, :, written] = src_kv[:, :, list(out.block_ids)[want_cached:]]
            assert prefill.core.release_pinned(rid)
            head = decode.core.admit_with_kv(rid, out.new_token_ids[0])
            assert head.new_token_ids + _drain(decode.core).get(rid, []) == expected, rid
        without = decode.core.reserve_for_kv("d", second, GREEDY)  # reuse not asked
        assert without is not None and without.num_cached_blocks == 0
        assert decode.core.abort_request("d")
        # b's third block is cached now (its KV arrived with b), its fourth never full
        aborted = decode.core.reserve_for_kv("e", second, GREEDY, reuse_prefix=True)
        assert aborted is not None and aborted.num_cached_blocks == 3
        assert decode.core.abort_request("e")
        assert decode.core.scheduler.cached_prefix(
            decode.core._make_request("f", second, GREEDY, False, 0)) == aborted.block_ids[:3]
        for most in (1, 0):
            capped = decode.core.reserve_for_kv("g", second, GREEDY, reuse_prefix=True,
                                                max_reused_blocks=most)
            assert capped is not None and capped.num_cached_blocks == most
            assert capped.block_ids[:most] == aborted.block_ids[:most]
            assert len(capped.blocks_to_write) == len(capped.block_ids) - most
            assert decode.core.abort_request("g")
        for engine in (prefill, decode):
            engine.core.check_integrity()
            assert engine.core.kv_usage().in_use == 0


def test_kv_received_quantised_is_keyed_apart_from_kv_computed_here(llama_dir: Path) -> None:
    """With ``kv_transfer_dtype="int8"`` a reserved prompt's KV arrives lossy: its blocks
    are cached under their own keys, so a later reservation of the prompt reuses them, while
    a request computed here never reads them (it computes in full precision, equal to a
    plain engine's output), and its own blocks never serve a reservation."""
    with LLM(llama_dir, num_kv_blocks=64) as prefill:
        cache = dataclasses.replace(prefill.config.cache, kv_transfer_dtype="int8")
        decode = EngineCore(dataclasses.replace(prefill.config, cache=cache), prefill.tokenizer)
        try:
            prompt = list(range(3, 3 + 40))  # 2 full blocks + 8 tokens
            expected = prefill.generate([prompt], GREEDY)[0].token_ids
            prefill.core.add_request("a", prompt, GREEDY, prefill_only=True)
            (out,) = _step_all(prefill.core)
            reserved = decode.reserve_for_kv("a", prompt, GREEDY, reuse_prefix=True)
            assert reserved is not None and reserved.num_cached_blocks == 0
            src = prefill.core.executor.runner.kv_cache[:, :, list(out.block_ids)]
            decode.executor.runner.kv_cache[:, :, reserved.block_ids] = dequantize(quantize(src))
            assert prefill.core.release_pinned("a")
            decode.admit_with_kv("a", out.new_token_ids[0])
            _drain(decode)
            # a reservation of the same prompt reuses the lossy blocks ...
            again = decode.reserve_for_kv("b", prompt, GREEDY, reuse_prefix=True)
            assert again is not None and again.num_cached_blocks == 2
            assert decode.abort_request("b")
            # ... a request computed here does not, and gives the plain engine's tokens
            local = decode._make_request("c", prompt, GREEDY, False, 0)
            assert decode.scheduler.cached_prefix(local) == []
            decode.add_request("c", prompt, GREEDY)
            assert _drain(decode)["c"] == expected
            # and the full-precision blocks it cached never serve a lossy reservation
            other = prompt[:32] + [7] * 9
            decode.add_request("d", other, GREEDY)
            _drain(decode)
            lossy = decode.reserve_for_kv("e", other, GREEDY, reuse_prefix=True)
            assert lossy is not None and lossy.num_cached_blocks == 2  # "a"'s, not "d"'s
            assert lossy.block_ids[:2] == again.block_ids[:2]
            assert decode.abort_request("e")
            decode.check_integrity()
            assert decode.kv_usage().in_use == 0
        finally:
            decode.shutdown()


def test_reservation_refused_when_pool_is_full(llama_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=4) as llm:
        core = llm.core
        assert core.reserve_for_kv("a", list(range(3, 50)), GREEDY) is not None  # 3 blocks
        assert core.reserve_for_kv("b", list(range(3, 40)), GREEDY) is None  # needs 3, 1 free
        assert core.kv_usage().in_use == 3
        assert core.abort_request("a")
        assert core.kv_usage().in_use == 0
        core.check_integrity()


def test_layer_hook_runs_after_each_layer_in_order(llm: LLM) -> None:
    core = llm.core
    seen: list[int] = []
    kv = core.executor.runner.kv_cache
    written: list[bool] = []

    def hook(layer: int) -> None:
        seen.append(layer)
        written.append(bool(kv[layer].abs().sum() > 0))

    core.layer_hook = hook
    try:
        kv.zero_()
        core.add_request("h", llm.encode("hook me"), SamplingParams(max_tokens=1))
        _step_all(core)
    finally:
        core.layer_hook = None
    n = llm.config.model.num_layers
    assert seen == list(range(n))
    assert all(written), "a layer's KV was not written when its hook ran"


def test_abort_frees_blocks_mid_decode(llm: LLM) -> None:
    core = llm.core
    core.add_request("a1", llm.encode(PROMPTS[0]), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.kv_usage().in_use > 0
    assert core.abort_request("a1") and not core.abort_request("a1")
    assert not core.has_unfinished()
    assert core.kv_usage().in_use == 0
    core.check_integrity()


@pytest.mark.parametrize("bad, message", [
    ([], "empty"),
    ([10**7], "token ids must be in"),
    ([5] * 2040, "context limit"),
])
def test_bad_prompts_rejected(llm: LLM, bad: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.core.add_request("bad", bad, GREEDY)
    assert "bad" not in llm.core.scheduler.requests


def test_request_larger_than_pool_rejected(llama_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=2) as llm, pytest.raises(ValueError, match="KV blocks"):
        llm.generate([list(range(3, 40))], GREEDY)


def test_stop_strings_and_stop_tokens(llm: LLM) -> None:
    prompt = PROMPTS[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    # stop at the third generated token id
    stop_id = free.token_ids[2]
    by_id = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0,
                                                  stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    # stop string taken from the middle of the free-running text
    text = free.text.replace("\ufffd", "")
    if len(text) >= 6:
        stop = text[3:6]
        res = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop=[stop],
                                                    ignore_eos=True))[0]
        assert res.finish_reason == "stop"
        assert stop not in res.text
        assert free.text.startswith(res.text)
    llm.core.check_integrity()


def test_seeded_sampling_independent_of_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    crowd = llm.generate(PROMPTS[:5], [GREEDY, params, GREEDY, params, GREEDY])
    assert crowd[1].token_ids == alone
    assert crowd[3].token_ids != alone or PROMPTS[3] == PROMPTS[1]
    torch.manual_seed(0)


def test_admit_that_finishes_at_once_frees_the_id(llm: LLM) -> None:
    core = llm.core
    prompt = llm.encode(PROMPTS[2])
    one = SamplingParams(max_tokens=1, temperature=0)
    assert core.reserve_for_kv("once", prompt, one) is not None
    out = core.admit_with_kv("once", 5, num_cached_tokens=len(prompt))
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == [5]
    assert out.num_cached_tokens == len(prompt)  # the prefill side's count
    assert core.kv_usage().in_use == 0
    # the id can be used again, and nothing is left behind
    assert core.reserve_for_kv("once", prompt, one) is not None
    assert core.abort_request("once")
    assert "once" not in core.scheduler.requests and not core._streams
    core.check_integrity()


def test_bad_admissions_and_reused_pinned_ids_are_refused(llm: LLM) -> None:
    core = llm.core
    prompt = llm.encode(PROMPTS[0])
    with pytest.raises(ValueError, match="no KV reservation"):
        core.admit_with_kv("nobody", 5)
    assert core.reserve_for_kv("r", prompt, GREEDY) is not None
    with pytest.raises(ValueError, match="first token id"):
        core.admit_with_kv("r", 10**6)
    with pytest.raises(ValueError, match="cached tokens"):
        core.admit_with_kv("r", 5, num_cached_tokens=len(prompt) + 1)
    assert core.abort_request("r")
    core.add_request("pinned", prompt, GREEDY, prefill_only=True)
    _step_all(core)
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("pinned", prompt, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        core.reserve_for_kv("pinned", prompt, GREEDY)
    assert core.release_pinned("pinned")
    assert not core._streams
    core.check_integrity()


def test_stop_string_on_the_last_token_reports_stop(llm: LLM) -> None:
    # find a prompt whose 8th (last) token adds text that appears nowhere before it
    for prompt in PROMPTS:
        free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True))[0]
        before = llm.generate([prompt], SamplingParams(max_tokens=7, temperature=0,
                                                       ignore_eos=True))[0].text
        added = free.text[len(before):].replace("\ufffd", "")
        if free.text.startswith(before) and added and added[-1] not in before:
            tail = added[-1]
            break
    else:
        raise AssertionError("no prompt gives a last token with new text")
    res = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop=[tail],
                                                ignore_eos=True))[0]
    assert res.token_ids == free.token_ids
    assert res.finish_reason == "stop"
    assert tail not in res.text


def test_stream_and_generate_do_not_interleave(llm: LLM) -> None:
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    next(stream)
    with pytest.raises(RuntimeError, match="still running"):
        llm.generate([PROMPTS[1]], GREEDY)
    stream.close()
    assert not llm.core.has_unfinished()
    assert llm.generate([PROMPTS[1]], GREEDY)[0].finish_reason == "length"


def test_two_engines_run_forwards_on_two_threads(llama_dir: Path) -> None:
    import threading

    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    with LLM(llama_dir, num_kv_blocks=64) as a, LLM(llama_dir, num_kv_blocks=64) as b:
        expected = a.generate([PROMPTS[0]], GREEDY)[0].token_ids

        def run(i: int, engine: LLM) -> None:
            try:
                for _ in range(5):
                    results[i] = engine.generate([PROMPTS[0]], GREEDY)[0].token_ids
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i, e)) for i, e in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    assert results == {0: expected, 1: expected}


def test_prefill_only_first_token_matching_a_stop_string_still_reports_pinned_blocks(
        llm: LLM) -> None:
    core = llm.core
    prompt = llm.encode(PROMPTS[0])
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    stop = first.text.replace("\ufffd", "")[:1]
    if not stop:
        pytest.skip("the first token has no printable text")
    core.add_request("pf", prompt, SamplingParams(max_tokens=5, temperature=0, stop=[stop]),
                     prefill_only=True)
    (out,) = [o for o in _step_all(core) if o.request_id == "pf"]
    assert out.finish_reason == "prefilled" and out.block_ids
    assert core.release_pinned("pf")
    core.check_integrity()
