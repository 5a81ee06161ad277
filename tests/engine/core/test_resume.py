"""A resumed request (``num_resumed_tokens``: the output streamed so far, prefilled with the
prompt, counted as output) continues exactly where the unfaulted run would have: the same
tokens (greedy and seeded), the same text (withheld text of a forming stop string neither
lost nor repeated), the same finish and usage. What a migrated stream relies on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.engine_core import EngineCore, RequestOutput
from tests.factories import PROMPTS

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def core(llama_dir: Path) -> Iterator[EngineCore]:
    with LLM(llama_dir, num_kv_blocks=128, max_num_seqs=4) as engine:
        yield engine.core


def _run(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams,
         resumed: int = 0) -> list[RequestOutput]:
    """Every output of one request, run alone (one token per step)."""
    core.add_request(rid, prompt, params, num_resumed_tokens=resumed)
    outputs: list[RequestOutput] = []
    while core.has_unfinished():
        outputs += [o for o in core.step() if o.request_id == rid]
    return outputs


def _prompt(core: EngineCore, text: str) -> list[int]:
    assert core.tokenizer is not None
    return list(core.tokenizer.tokenizer.encode(text).ids)


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outputs)


PARAMS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=7,
                             ignore_eos=True),
}


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_a_resumed_request_continues_the_unfaulted_one(core: EngineCore, kind: str) -> None:
    params = PARAMS[kind]
    prompt = _prompt(core, PROMPTS[0])
    whole = _run(core, f"{kind}-whole", prompt, params)
    tokens = _tokens(whole)
    assert len(tokens) == MAX_TOKENS and len(whole) == MAX_TOKENS  # one token per step
    for k in (1, 9, MAX_TOKENS - 1):
        rest = _run(core, f"{kind}-{k}", prompt + tokens[:k], params, resumed=k)
        assert _tokens(rest) == tokens[k:], k
        assert _text(whole[:k]) + _text(rest) == _text(whole), k
        last = rest[-1]
        assert last.finished and last.finish_reason == whole[-1].finish_reason == "length"
        assert (last.num_prompt_tokens, last.num_resumed_tokens) == (len(prompt), k)
    core.check_integrity()


def test_text_withheld_for_a_stop_string_is_neither_lost_nor_repeated(core: EngineCore) -> None:
    prompt = _prompt(core, PROMPTS[3])
    free = _run(core, "free", prompt, PARAMS["greedy"])
    text = _text(free)
    # a stop string that begins mid-output and ends past several more tokens' text
    start = len(_text(free[:MAX_TOKENS // 2]))
    stop = text[start:start + 12].strip() or text[start:start + 12]
    assert len(stop) >= 2, text
    params = replace(PARAMS["greedy"], stop=(stop + "\x00", stop[:len(stop) // 2] + "\x01"))
    stopping = replace(PARAMS["greedy"], stop=(stop,))
    whole = _run(core, "stop-whole", prompt, stopping)
    assert whole[-1].finish_reason == "stop" and stop not in _text(whole)
    tokens = _tokens(whole)
    # resume at every token: some of them while text is withheld (it may begin the stop)
    withheld_somewhere = False
    for k in range(1, len(tokens)):
        sent = _text(whole[:k])
        rest = _run(core, f"stop-{k}", prompt + tokens[:k], stopping, resumed=k)
        assert _tokens(rest) == tokens[k:], k
        assert sent + _text(rest) == _text(whole), k
        assert rest[-1].finish_reason == "stop", k
        withheld_somewhere |= len(sent) < len(_text(free[:k]))
    assert withheld_somewhere  # the scenario did hold text back at some resume point
    # stop strings that never match hold text back too, and release it at the end
    rest = _run(core, "never", prompt + tokens[:3], params, resumed=3)
    full = _run(core, "never-whole", prompt, params)
    assert _text(full[:3]) + _text(rest) == _text(full)
    core.check_integrity()


def test_resumed_tokens_count_as_output(core: EngineCore) -> None:
    prompt = _prompt(core, PROMPTS[0])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = _tokens(_run(core, "four", prompt, params))
    rest = _run(core, "four-3", prompt + tokens[:3], params, resumed=3)
    assert _tokens(rest) == tokens[3:] and rest[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="nothing to generate"):
        core.add_request("four-4", prompt + tokens, params, num_resumed_tokens=4)
    with pytest.raises(ValueError, match="the client's prompt must remain"):
        core.add_request("all", tokens[:3], params, num_resumed_tokens=3)
    limit = min(core.config.model.max_model_len,
                core.block_manager.num_blocks * core.config.cache.block_size)
    long = SamplingParams(max_tokens=limit - len(prompt), temperature=0.0)
    core.add_request("fits", prompt + tokens[:3], long, num_resumed_tokens=3)  # not over
    core.abort_request("fits")
    core.check_integrity()
