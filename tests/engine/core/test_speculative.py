"""Speculative decoding by n-gram lookup (``engine.core.speculative``): the proposer and
the acceptance rule by hand; through the real engine, greedy and seeded output equal to
decoding without it on every architecture, in mixed batches (requests that cannot
speculate, a prompt being prefilled in chunks, stop tokens, ``max_tokens`` cut short,
a pool small enough to leave no room to guess), at TP 2; rejected guesses never reach
the prefix cache; an abort mid-speculation frees every block; the verification keeps
the sampler's distribution (chi-square at temperature 1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.core.engine_core import EngineCore
from engine.core.sampler import sample
from engine.core.scheduler import SchedulerStats
from engine.core.speculative import accepted, propose_ngram
from engine.text.tokenizer import load_tokenizer
from tests.engine.kernels.test_int8 import ARCHS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)


def same_tokens(model_dir: Path, prompts: list[list[int]],
                params: SamplingParams | list[SamplingParams], speculative_config: object,
                plain: dict[str, Any] | None = None, **kwargs: Any) -> SchedulerStats:
    """Generates ``prompts`` without and with ``speculative_config`` (both engines built
    with ``kwargs``, the plain one with ``plain`` instead where given), asserts the tokens
    are the same and that the speculative engine ends holding no block; its stats."""
    with LLM(model_dir, **(kwargs if plain is None else plain)) as engine:
        expected = [r.token_ids for r in engine.generate(prompts, params)]
    with LLM(model_dir, speculative_config=speculative_config, **kwargs) as spec:
        assert [r.token_ids for r in spec.generate(prompts, params)] == expected
        spec.core.check_integrity()
        assert spec.core.kv_usage().in_use == 0
        return spec.stats


def test_the_proposal_follows_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 2, 1) == [3, 4, 1]
    assert propose_ngram([5, 1, 9, 1, 7, 1], 2, 1, 1) == [7, 1]  # the latest occurrence
    # [2, 3] occurred twice, [9, 2, 3] once: the longest suffix wins
    assert propose_ngram([9, 2, 3, 5, 2, 3, 6, 9, 2, 3], 2, 3, 1) == [5, 2]
    assert propose_ngram([1, 2, 3], 4, 3, 1) == []  # nothing repeats
    assert propose_ngram([1, 2, 1], 4, 3, 2) == []  # shorter than prompt_lookup_min
    assert propose_ngram([4, 4], 3, 2, 1) == [4]  # what follows, however little
    # token 1's bytes lie inside token 256's, one byte along: not an occurrence
    assert propose_ngram([256, 0, 5, 1], 2, 1, 1) == []
    assert propose_ngram([2**40, 3, 2**40], 1, 1, 1) == [3]


def test_drafts_are_kept_while_they_equal_what_the_sampler_drew() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all kept, and one more
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the first differing draw ends it
    assert accepted([5, 6], [4, 6, 7]) == [4]


def test_a_speculative_config_it_cannot_run_is_refused(llama_dir: Path) -> None:
    for bad, match in (({"method": "ngram", "draft": "x", "num_speculative_tokens": 2},
                        "unknown keys"),
                       ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 99}, "<= 16"),
                       ("{not json", "not JSON")):
        with pytest.raises(ConfigError, match=match):
            LLM(llama_dir, speculative_config=bad)


MIXED_ENGINE = {"num_kv_blocks": 96, "max_num_seqs": 8, "max_num_batched_tokens": 48}


def _mixed(model_dir: Path) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts and parameters of a mixed batch: a repeated text (its output soon repeats
    too), seeded sampling, a penalised request (never speculates), stop tokens, a long
    prompt prefilled in chunks meanwhile, a short ``max_tokens``."""
    text = "the cat sat on the mat and the cat sat on the mat again"
    base = list(load_tokenizer(model_dir).tokenizer.encode(text).ids)
    prompts = [base * 2, base + [7, 8, 9] * 6, base, base[::-1] * 2, list(range(3, 300)),
               base * 3]
    params = [GREEDY,
              SamplingParams(max_tokens=80, temperature=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=64, temperature=0.0, presence_penalty=0.5,
                             ignore_eos=True),
              SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True,
                             stop_token_ids=(base[3],)),
              GREEDY,
              SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)]
    return prompts, params


@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_changes_no_greedy_or_seeded_token(model_factory: Callable[..., Path],
                                                       arch: str) -> None:
    model_dir = model_factory(arch)
    stats = same_tokens(model_dir, *_mixed(model_dir), NGRAM, **MIXED_ENGINE)
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens


def test_a_pool_with_no_room_to_guess_decodes_as_before(llama_dir: Path) -> None:
    """16 blocks of 16 for two 150-token sequences: a guess is made only where it leaves a
    block for each request still to be scheduled, so guessing preempts no more than
    decoding does (preemption itself still works)."""
    prompts = [list(range(3, 40)) * 2, list(range(50, 80)) * 2]
    kwargs = {"num_kv_blocks": 16, "max_num_batched_tokens": 32}
    params = SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, **kwargs) as plain:  # type: ignore[arg-type]
        expected = [r.token_ids for r in plain.generate(prompts, params)]
        preempted = plain.stats.num_preemptions
    with LLM(llama_dir, speculative_config=NGRAM, **kwargs) as spec:  # type: ignore[arg-type]
        assert [r.token_ids for r in spec.generate(prompts, params)] == expected
        assert spec.stats.num_accepted_tokens > 0
        # guesses never take the block another running request needs next
        assert 0 < spec.stats.num_preemptions <= preempted


def test_a_prompts_last_token_is_never_speculated_from(llama_dir: Path) -> None:
    """A prompt whose last chunk is one token (49 tokens, a budget of 48) samples its first
    token alone (an output read after several tokens of one step would lose the prompt
    logprobs that come with the first); the steps after it guess."""
    prompt = [5, 6, 7, 8] * 12 + [5]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    with LLM(llama_dir, max_num_batched_tokens=48) as plain:
        expected = plain.generate([prompt], params)[0]
    with LLM(llama_dir, max_num_batched_tokens=48, speculative_config=NGRAM) as llm:
        core = llm.core
        core.add_request("x", prompt, params)
        steps = []
        while core.has_unfinished():
            out = core.scheduler.schedule()
            steps.append([(c.start_position, c.num_draft_tokens) for c in out.chunks])
            core.scheduler.update(out, core._execute(out))
        assert steps[:2] == [[(0, 0)], [(48, 0)]]  # the prompt, then its last token alone
        assert any(n for step in steps[2:] for _, n in step)  # then guesses
        got = llm.generate([prompt], params)[0]
    assert got.token_ids == expected.token_ids and got.prompt_logprobs is not None
    assert got.prompt_logprobs == expected.prompt_logprobs


def test_tp_2_speculates_as_tp_1_decodes(llama_dir: Path) -> None:
    prompts = [[5, 6, 7, 8] * 12, list(range(3, 60)) * 2]
    stats = same_tokens(llama_dir, prompts, GREEDY, NGRAM, plain={}, tensor_parallel_size=2)
    assert stats.num_accepted_tokens > 0


def test_over_int8_weights_and_an_int8_kv_cache_speculation_changes_no_token(
        llama_dir: Path) -> None:
    """The guesses are decode rows of the step (each attends to the K/V written before it
    in the same step): so too over an int8 cache, read dequantised."""
    prompts = [[5, 6, 7, 8] * 12, list(range(3, 60)) * 2]
    stats = same_tokens(llama_dir, prompts, GREEDY, NGRAM, quantization="int8",
                        kv_cache_dtype="int8")
    assert stats.num_accepted_tokens > 0


def test_rejected_guesses_never_reach_the_prefix_cache(llama_dir: Path) -> None:
    """A continuation of a speculated stream reuses the blocks its decoding cached
    (guesses were rejected along the way) and gives what a fresh engine gives."""
    prompt = [9, 10, 11, 12, 13] * 8
    follow = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, speculative_config=NGRAM) as spec:
        first = spec.generate([prompt], GREEDY)[0].token_ids
        assert spec.stats.num_draft_tokens > spec.stats.num_accepted_tokens  # some rejected
        longer = prompt + first[:80]
        again = spec.generate([longer], follow)[0]
    assert again.num_cached_tokens >= len(prompt) + 64  # decoded blocks served it
    with LLM(llama_dir) as fresh:
        assert fresh.generate([longer], follow)[0].token_ids == again.token_ids


def test_a_step_gives_each_request_one_output_with_every_token_it_kept(llama_dir: Path) -> None:
    """A speculated request's kept tokens come as one output of the step (its text with
    them), so a stream's inter-token latency counts steps, not tokens of one step."""
    with LLM(llama_dir, speculative_config=NGRAM) as llm:
        core = llm.core
        core.add_request("a", [5, 6, 7, 8] * 12, GREEDY)
        core.add_request("b", [9, 10, 11] * 12, GREEDY)
        sizes: list[int] = []
        while core.has_unfinished():
            outputs = core.step()
            assert len({o.request_id for o in outputs}) == len(outputs)
            sizes += [len(o.new_token_ids) for o in outputs]
        assert max(sizes) > 1 and sum(sizes) == 2 * GREEDY.max_tokens


def test_an_abort_mid_speculation_frees_every_block(llama_dir: Path) -> None:
    with LLM(llama_dir) as engine:
        config = dataclasses.replace(
            engine.config, scheduler=dataclasses.replace(
                engine.config.scheduler, speculative_method="ngram", num_speculative_tokens=4,
                prompt_lookup_max=3))
        core = EngineCore(config, engine.tokenizer)
        try:
            for i in range(3):
                core.add_request(f"r{i}", [20 + i, 21, 22, 23] * 10, GREEDY)
            for _ in range(200):  # steps until one guesses; it is aborted in flight
                out = core.scheduler.schedule()
                if any(c.num_draft_tokens for c in out.chunks):
                    break
                core.scheduler.update(out, core._execute(out))
            assert any(c.num_draft_tokens for c in out.chunks)
            for i in range(3):
                assert core.abort_request(f"r{i}")
            core.scheduler.update(out, [(1,) * (c.num_draft_tokens + 1) if c.num_draft_tokens
                                        else 1 for c in out.chunks if c.sample])
            core.check_integrity()
            assert core.kv_usage().in_use == 0 and not core.has_unfinished()
        finally:
            core.shutdown()


def test_the_token_kept_in_a_guesss_place_follows_the_model_at_temperature_1() -> None:
    """What verification keeps where a guess stood is the sampler's draw there, so it
    follows the model's distribution whatever was guessed — for a one-token guess, the
    rejection-sampling rule (kept with probability ``p(guess)``, else drawn from ``p``
    without it). Chi-square over 8 tokens (7 degrees of freedom; 24.3 is the 0.1 %
    critical value) for each of two guesses; the guess is kept with ``p(guess)``."""
    torch.manual_seed(0)
    probs = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.07, 0.05, 0.03])
    logits = probs.log().repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, max_tokens=8)] * 4000
    for guess in (1, 6):
        draws = sample(logits, params, list(range(4000)))
        emitted = [accepted([guess, 0], [d, 0])[0] for d in draws]
        counts = torch.bincount(torch.tensor(emitted), minlength=8).double()
        expected = probs.double() * len(emitted)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 24.3, (guess, chi2, counts.tolist())
        kept = sum(len(accepted([guess, 0], [d, 0])) > 1 for d in draws) / len(draws)
        assert abs(kept - float(probs[guess])) < 0.03


def test_seeded_sampling_at_temperature_1_is_unchanged_for_every_seed(llama_dir: Path) -> None:
    """The stronger property, through the engine: at temperature 1, for 24 seeds, the
    speculative stream is the plain one token for token (with guesses kept and rejected
    along the way), so its tokens follow the model as the plain stream's do."""
    prompt = [5, 6, 7, 8] * 12
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True)
              for s in range(24)]
    stats = same_tokens(llama_dir, [prompt] * 24, params, NGRAM)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_a_step_with_more_running_requests_than_disable_by_batch_size_does_not_guess(
        llama_dir: Path) -> None:
    """vLLM's ``disable_by_batch_size``: 3 requests running, a limit of 2: no guesses until
    one of them has finished; the tokens are the plain ones."""
    prompts = [[5, 6, 7, 8] * 12, [9, 10, 11] * 12, [12, 13] * 20]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (30, 60, 60)]
    config = {**NGRAM, "disable_by_batch_size": 2}
    with LLM(llama_dir) as plain:
        expected = [r.token_ids for r in plain.generate(prompts, params)]
    with LLM(llama_dir, speculative_config=config) as llm:
        core = llm.core
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            core.add_request(f"r{i}", prompt, p)
        steps = []
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
        while core.has_unfinished():
            running = len(core.scheduler.running)
            out = core.scheduler.schedule()
            steps.append((running, sum(c.num_draft_tokens for c in out.chunks)))
            for update in core.scheduler.update(out, core._execute(out)):
                tokens[update.request.request_id].append(update.new_token_id)
    assert all(drafts == 0 for running, drafts in steps if running == 3)
    assert any(drafts for running, drafts in steps if running < 3)
    assert [tokens[f"r{i}"] for i in range(3)] == expected
    with pytest.raises(ConfigError, match="disable_by_batch_size"):
        LLM(llama_dir, speculative_config={**NGRAM, "disable_by_batch_size": 0})
