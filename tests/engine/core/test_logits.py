"""Penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` (``engine.core.logits``, the
sampler): the engine's greedy output equals a reference loop written here over Hugging
Face's logits of the same checkpoint; ``min_tokens`` with a bias that forces EOS gives
exactly ``min_tokens`` tokens before it; a resumed request penalizes its resumed tokens as
output; bad values are refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.logits import History, process_logits
from tests.factories import PROMPTS

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir, num_kv_blocks=128) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf(llama_dir: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)


def reference(hf: Any, prompt: list[int], p: SamplingParams, eos: tuple[int, ...]
              ) -> list[int]:
    """Greedy decoding with the rules written out, one token at a time."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float().clone()
            for token_id, bias in p.logit_bias:
                logits[token_id] += bias
            if len(out) < p.min_tokens:
                for t in (*eos, *p.stop_token_ids):
                    logits[t] = float("-inf")
            for t in set(prompt) | set(out):
                v = float(logits[t])
                logits[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            for t in set(out):
                logits[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
            out.append(int(logits.argmax()))
            if out[-1] in eos and not p.ignore_eos:
                break
    return out


CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition-below-1": dict(repetition_penalty=0.6),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.9),
    "all-three": dict(presence_penalty=0.5, frequency_penalty=-0.4, repetition_penalty=1.3),
    "bias": dict(logit_bias={7: 100.0, 11: 3.5}, presence_penalty=2.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_penalties_equals_the_reference_loop(llm: LLM, hf: Any, case: str) -> None:
    p = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, **CASES[case])
    result = llm.generate([PROMPTS[4]], p)[0]  # its plain output repeats tokens
    prompt = list(result.prompt_token_ids)
    assert list(result.token_ids) == reference(hf, prompt, p, ())
    plain = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                                      ignore_eos=True))[0]
    assert result.token_ids != plain.token_ids  # the penalty changed something


def test_min_tokens_holds_eos_back_exactly_so_long(llm: LLM, hf: Any) -> None:
    eos = llm.core.tokenizer.eos_token_ids if llm.core.tokenizer else ()
    assert eos
    force = {eos[0]: 100.0}  # EOS wins whenever it may
    for min_tokens in (0, 1, 5):
        p = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=min_tokens,
                           logit_bias=force)
        result = llm.generate([PROMPTS[2]], p)[0]
        assert list(result.token_ids) == reference(hf, list(result.prompt_token_ids), p, eos)
        assert len(result.token_ids) == min_tokens + 1 and result.token_ids[-1] == eos[0]
        assert eos[0] not in result.token_ids[:-1] and result.finish_reason == "stop"
    stop_id = 9  # a stop token id is held back too
    p = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=3, stop_token_ids=(stop_id,),
                       logit_bias={stop_id: 100.0}, ignore_eos=True)
    tokens = llm.generate([PROMPTS[2]], p)[0].token_ids
    assert list(tokens)[3:] == [stop_id] and stop_id not in tokens[:3]


def test_resumed_output_is_penalized_as_output(llm: LLM) -> None:
    core = llm.core
    assert core.tokenizer is not None
    prompt = list(core.tokenizer.tokenizer.encode(PROMPTS[3]).ids)
    p = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, seed=11, ignore_eos=True,
                       presence_penalty=1.2, frequency_penalty=0.7, min_tokens=NUM_TOKENS)

    def run(rid: str, tokens: list[int], resumed: int) -> list[int]:
        core.add_request(rid, tokens, p, num_resumed_tokens=resumed)
        out: list[int] = []
        while core.has_unfinished():
            out += [t for o in core.step() if o.request_id == rid for t in o.new_token_ids]
        return out

    whole = run("whole", prompt, 0)
    assert run("resumed", prompt + whole[:5], 5) == whole[5:]


def test_min_p_keeps_only_the_likely_and_process_logits_leaves_plain_rows() -> None:
    from engine.core.sampler import sample

    logits = torch.tensor([[4.0, 3.9, 0.0, -5.0]] * 64)
    kept = SamplingParams(temperature=1.0, min_p=0.5, seed=1)
    picked = {sample(logits[i:i + 1], [kept], [i])[0] for i in range(64)}
    assert picked == {0, 1}  # 2 and 3 are less than half as likely as 0
    plain = SamplingParams()
    assert process_logits(logits, [plain], [History((), ())]) is logits


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be finite and > 0"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be in"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
    (dict(logit_bias={1: float("inf")}), "logit_bias values"),
])
def test_bad_values_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_bias_is_clamped_to_a_hundred() -> None:
    assert SamplingParams(logit_bias={5: 1e9, 2: -1e9}).logit_bias == ((2, -100.0), (5, 100.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_are_processed_as_on_the_cpu() -> None:
    logits = torch.randn(3, 500)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                             repetition_penalty=1.25, logit_bias={4: 3.0}, min_tokens=5),
              SamplingParams(), SamplingParams(repetition_penalty=0.5)]
    histories = [History(torch.tensor([1, 2, 3]), [4, 4, 9], (2,)), History((), ()),
                 History([7, 8], [8])]
    cpu = process_logits(logits, params, histories)
    assert torch.equal(process_logits(logits.cuda(), params, histories).cpu(), cpu)


def test_stop_strings_wait_for_min_tokens_as_in_vllm(llm: LLM) -> None:
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0,
                                                     ignore_eos=True))[0]
    stop = free.text[:3]
    assert len(stop) == 3
    early = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True, stop=(stop,)))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 12
    held = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0,
                                                     ignore_eos=True, stop=(stop,),
                                                     min_tokens=12))[0]
    assert held.token_ids == free.token_ids and held.text == free.text
