"""Structured outputs in the engine (``engine.grammar``, ``engine.core.constrain``): on the
tiny random model, whose own preferences are noise, seeded sampling at temperature 1 gives
output that parses and validates against each bounded JSON Schema, matches each regex and
choice, and stops (``"stop"``) inside ``max_tokens``; a resumed request continues the
grammar over its resumed tokens; what the library rejects is refused with its message;
every matcher is released when its request ends."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput
from tests.factories import PROMPTS

SCHEMAS: dict[str, dict[str, Any]] = {
    "enum": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
             "required": ["answer"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["tags"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "note": {"type": "string", "maxLength": 5}},
        "required": ["id"], "additionalProperties": False},
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir, num_kv_blocks=256) as engine:
        yield engine


def _params(structured: StructuredOutput, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                          structured=structured)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schemas_hold_whatever_the_model_prefers(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    structured = StructuredOutput("json", json.dumps(schema))
    results = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(4)],
                           [_params(structured, seed) for seed in range(4)])
    for r in results:
        assert r.finish_reason == "stop" and len(r.token_ids) < MAX_TOKENS, r.text
        jsonschema.validate(json.loads(r.text), schema)
    assert llm.core.constraints._matchers == {}  # every one released


def test_regex_choice_json_object_and_grammar(llm: LLM) -> None:
    cases = [(StructuredOutput("regex", r"[0-9]{3}-[a-z]{2}"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             (StructuredOutput("choice", json.dumps(["red", "green", "blue"])),
              lambda t: t in ("red", "green", "blue")),
             (StructuredOutput("grammar", 'start: "(" NUM ("," NUM)~0..2 ")"\nNUM: /[0-9]/'),
              lambda t: re.fullmatch(r"\([0-9](,[0-9]){0,2}\)", t))]
    for structured, check in cases:
        for r in llm.generate([PROMPTS[0], PROMPTS[1]],
                              [_params(structured, s) for s in (5, 6)]):
            assert r.finish_reason == "stop" and check(r.text), (structured.kind, r.text)
    unbounded = llm.generate([PROMPTS[2]], SamplingParams(
        max_tokens=40, temperature=1.0, seed=1, structured=StructuredOutput("json_object")))[0]
    assert unbounded.text.startswith("{")  # free keys: may run to max_tokens, stays JSON
    greedy = llm.generate([PROMPTS[3]], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0,
        structured=StructuredOutput("json", json.dumps(SCHEMAS["enum"]))))[0]
    assert json.loads(greedy.text)["answer"] in ("yes", "no", "maybe")


def test_a_resumed_request_goes_on_in_its_grammar(llm: LLM) -> None:
    structured = StructuredOutput("json", json.dumps(SCHEMAS["nested"]))
    whole = llm.generate([PROMPTS[4]], _params(structured, 9))[0]
    prompt = llm.encode(PROMPTS[4])
    split = len(whole.token_ids) // 2
    llm.core.add_request("resumed", prompt + whole.token_ids[:split], _params(structured, 9),
                         num_resumed_tokens=split)
    rest: list[int] = []
    while llm.core.has_unfinished():
        for out in llm.core.step():
            rest += out.new_token_ids
    assert whole.token_ids[:split] + rest == whole.token_ids


def test_what_the_library_rejects_is_refused_with_its_message(llm: LLM) -> None:
    for structured, message in ((StructuredOutput("json", '{"type": "nope"}'), "nope"),
                                (StructuredOutput("json", "{not json"), "invalid"),
                                (StructuredOutput("regex", "(("), "unclosed group"),
                                (StructuredOutput("choice", "[]"), "non-empty list"),
                                (StructuredOutput("grammar", "start: missing"), "missing")):
        with pytest.raises(ValueError, match=message):
            llm.core.add_request("bad", [5, 6, 7], SamplingParams(structured=structured))
    with pytest.raises(ValueError, match="kind must be one of"):
        StructuredOutput("yaml", "a: b")
    assert not llm.core.has_unfinished()


def test_a_refused_resume_holds_nothing_and_an_unusable_tokenizer_refuses_only_these(
        llm: LLM, llama_dir: Path) -> None:
    from engine.core.constrain import Constraints
    from engine.core.request import Request
    from engine.grammar import Grammars

    structured = StructuredOutput("choice", json.dumps(["yes", "no"]))
    in_use = llm.core.kv_usage().in_use
    bad_resume = llm.encode(PROMPTS[0]) + llm.encode("zzz")  # not a prefix of yes / no
    with pytest.raises(ValueError, match="do not match the structured output"):
        llm.core.reserve_for_kv("r1", bad_resume, SamplingParams(
            max_tokens=8, structured=structured), num_resumed_tokens=len(llm.encode("zzz")))
    assert "r1" not in llm.core.scheduler.reserved and not llm.core.has_unfinished()
    assert llm.core.kv_usage().in_use == in_use
    tokenizer_json = (llama_dir / "tokenizer.json").read_text()
    broken = Constraints(lambda: Grammars(tokenizer_json, 10, [2]))  # fewer ids than tokens
    request = Request("r2", [5, 6], SamplingParams(structured=structured))
    with pytest.raises(ValueError, match="structured outputs are unavailable"):
        broken.check(request)
    broken.check(Request("r3", [5, 6], SamplingParams()))  # the others are untouched


def test_masks_made_ahead_are_the_masks_of_the_matchers_as_they_are_when_used(
        llama_dir: Path) -> None:
    """A step's masks made ahead (on the mask thread, once the previous step's tokens are
    followed) equal masks made in the step, also after a token followed between steps (as
    ``admit_with_kv`` does), for a request opened between steps, and with a request gone."""
    import torch

    from engine.core.constrain import Constraints
    from engine.core.request import Request
    from engine.grammar import Grammars

    tokenizer_json = (llama_dir / "tokenizer.json").read_text()
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    ahead = Constraints(lambda: Grammars(tokenizer_json, vocab, [2]), masks_ahead=True)
    in_step = Constraints(lambda: Grammars(tokenizer_json, vocab, [2]), masks_ahead=False)
    structured = StructuredOutput("json", json.dumps(SCHEMAS["nested"]))
    requests = {f"r{i}": Request(f"r{i}", [5, 6], SamplingParams(structured=structured))
                for i in range(4)}
    live = ["r0", "r1", "r2"]
    for engine in (ahead, in_step):
        for rid in live:
            engine.open(requests[rid])
    generator = torch.Generator().manual_seed(0)
    for step in range(12):
        logits = torch.randn(len(live), vocab, generator=generator)
        masked = ahead.mask(logits, live)
        assert torch.equal(masked, in_step.mask(logits, live)), step
        tokens = masked.argmax(dim=-1).tolist()
        for engine in (ahead, in_step):
            engine.follow_step(live, tokens)
        if step == 3:  # a token that came from elsewhere, between two steps
            extra = in_step.mask(torch.zeros(1, vocab), ["r1"]).argmax().item()
            for engine in (ahead, in_step):
                engine.follow("r1", [extra])
        if step == 5:  # one more request, and one gone
            for engine in (ahead, in_step):
                engine.open(requests["r3"])
                engine.close("r0")
            live = ["r1", "r2", "r3"]
    assert ahead._pending is not None and in_step._pending is None  # made ahead
    ahead.shutdown()
    in_step.shutdown()
