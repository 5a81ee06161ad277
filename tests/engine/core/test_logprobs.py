"""Logprobs (``SamplingParams.logprobs``, ``engine.core.logprobs``): each sampled token's
log-probability, rank and likeliest alternatives equal the log-softmax of Hugging Face's
logits of the same checkpoint, whatever the sampler did (penalties, temperature, top-k);
the rank and top entries are computed as vLLM does; bad values are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.logprobs import token_logprobs
from tests.factories import PROMPTS

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir, num_kv_blocks=128) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf(llama_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)


def test_token_logprobs_reports_the_chosen_token_its_rank_and_the_top_ones() -> None:
    logits = torch.tensor([[2.0, 1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    first, second = token_logprobs(logits, [1, 4], [3, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert first.token_id == 1 and first.logprob == pytest.approx(float(expected[0, 1]))
    assert first.rank == 4  # 3.0, 3.0 and 2.0 are likelier
    assert [t for t, _ in first.top][:1] in ([2], [3]) and {t for t, _ in first.top} == {0, 2, 3}
    assert [v for _, v in first.top] == pytest.approx(sorted(expected[0].tolist())[::-1][:3])
    assert second.rank == 1 and second.top == ()
    tied = token_logprobs(logits[:1], [3], [0])[0]
    assert tied.rank == 1  # a tie shares the better rank


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=5, seed=11),
    dict(temperature=0.0, repetition_penalty=1.6, presence_penalty=1.0, logit_bias={9: 5.0}),
], ids=["greedy", "seeded-top-k", "penalized"])
def test_logprobs_equal_hugging_faces_log_softmax_of_the_raw_logits(
        llm: LLM, hf: Any, sampling: dict[str, Any]) -> None:
    prompt = PROMPTS[2]
    result = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5,
                                                   **sampling))[0]
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) == 12
    with torch.no_grad():
        ids = torch.tensor([result.prompt_token_ids + result.token_ids])
        logits = hf(ids).logits[0, len(result.prompt_token_ids) - 1:-1].float()
    reference = torch.log_softmax(logits, dim=-1)
    for i, (token_id, found) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert found.token_id == token_id
        assert found.logprob == pytest.approx(float(reference[i, token_id]), abs=1e-4)
        assert found.rank == int((reference[i] > reference[i, token_id] + 1e-5).sum()) + 1
        top_values, top_ids = reference[i].topk(5)
        assert [v for _, v in found.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert [t for t, _ in found.top][:2] == top_ids.tolist()[:2]
    if sampling.get("repetition_penalty"):  # the penalties changed what was sampled
        assert any(lp.rank > 1 for lp in result.logprobs)


def test_no_logprobs_unless_asked_and_bad_values_are_refused(llm: LLM) -> None:
    plain = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert plain.logprobs is None
    only = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0.0,
                                                     logprobs=0))[0]
    assert only.logprobs is not None and [lp.top for lp in only.logprobs] == [(), (), ()]
    assert [lp.token_id for lp in only.logprobs] == plain.token_ids
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(ValueError, match="logprobs must be in"):
            SamplingParams(logprobs=bad)  # type: ignore[arg-type]
    for bad in (-1, 21, True):
        with pytest.raises(ValueError, match="prompt_logprobs must be in"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]


def test_prompt_logprobs_equal_hugging_faces_over_chunks_and_a_cached_prefix(
        llama_dir: Path, hf: Any) -> None:
    """Every prompt token after the first: its log-probability given the ones before, its
    rank and the 3 likeliest there, as Hugging Face's log-softmax says — with the prompt
    prefilled in chunks of 16 and its prefix already cached (the cache is bypassed), in
    one batch with a request that does not ask; the output is the plain one."""
    prompt_ids = list(range(5, 5 + 45))
    ask = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(llama_dir, num_kv_blocks=64, max_num_batched_tokens=16) as llm:
        warm = llm.generate([prompt_ids], plain)[0]  # the prefix is cached now
        asked, other = llm.generate([prompt_ids, list(range(60, 90))], [ask, plain])
    assert warm.prompt_logprobs is None and other.prompt_logprobs is None
    assert asked.token_ids == warm.token_ids and asked.num_cached_tokens == 0
    found = asked.prompt_logprobs
    assert found is not None and [lp.token_id for lp in found] == prompt_ids[1:]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt_ids])).logits[0, :-1].float()
    reference = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(found):
        assert lp.logprob == pytest.approx(float(reference[i, lp.token_id]), abs=1e-4)
        assert lp.rank == int((reference[i] > reference[i, lp.token_id] + 1e-5).sum()) + 1
        assert [v for _, v in lp.top] == pytest.approx(reference[i].topk(3).values.tolist(),
                                                       abs=1e-4)


def test_prompt_logprobs_recorded_once_whatever_a_recompute_s_chunks() -> None:
    # a request preempted after its first 8-token chunk is recomputed from position 0 in
    # chunks that need not end where the first run's did: the positions already recorded
    # are kept, the rest recorded from the first chunk that reaches past them
    from engine.core.chunks import ScheduledChunk
    from engine.core.logprobs import prompt_logprobs
    from engine.core.request import Request

    vocab, prompt = 50, list(range(3, 23))  # 20 tokens: 19 positions to predict
    request = Request("r", prompt, SamplingParams(max_tokens=2, prompt_logprobs=0),
                      eos_token_ids=(1,))
    logits = torch.randn(20, vocab, generator=torch.Generator().manual_seed(0))

    def chunk(start: int, end: int) -> None:
        piece = ScheduledChunk("r", tuple(prompt[start:end]), start, (), end == 20, True)
        prompt_logprobs(logits[start:end], [piece], {"r": request})

    chunk(0, 8)  # the first run, then preempted
    first = list(request.prompt_logprobs)
    for start, end in ((0, 6), (6, 13), (13, 20)):  # the recompute
        chunk(start, end)
    assert len(request.prompt_logprobs) == 19 and request.prompt_logprobs[:8] == first
    assert request.prompt_logprobs == token_logprobs(logits[:19], prompt[1:], [0] * 19)
