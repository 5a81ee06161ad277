"""Penalties, ``min_p``, ``min_tokens``, ``logit_bias`` and logprobs give one answer
everywhere: the disaggregated cluster (the first token sampled on the prefill worker, the rest on the
decode worker), the colocated one (``--local-prefill always``: all on the decode worker),
the HTTP API through the official ``openai`` SDK (chat and completions) and ``engine.LLM``
— greedy and seeded. Real processes: one prefill and one decode worker, two routers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput
from pdserve import Client, PdserveError
from tests.e2e.cluster import Cluster, scrape_metrics
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1}
# values exact in float32 (the API carries them as 32-bit floats)
CASES: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.75},
    "presence-frequency": {"presence_penalty": 1.5, "frequency_penalty": 0.75},
    "bias-min-tokens": {"logit_bias": {7: 100.0, 12: -100.0}, "min_tokens": 4},
    "everything": {"presence_penalty": -0.5, "frequency_penalty": 1.25,
                   "repetition_penalty": 1.25, "min_p": 0.125, "logit_bias": {3: 8.0}},
}
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.25, "seed": 17}}


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def colocated(cluster: Cluster) -> Iterator[Client]:
    router = cluster.start_router("--local-prefill", "always", name="router-colocated")
    with Client(router.address) as client:
        yield client
    router.stop()
    cluster.routers.remove(router)


def _params(case: str, sampling: str) -> SamplingParams:
    return SamplingParams(max_tokens=20, ignore_eos=True, **SAMPLING[sampling],
                          **CASES[case])


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("case", sorted(CASES))
def test_disaggregated_equals_colocated_equals_the_engine(
        cluster: Cluster, colocated: Client, llm: LLM, case: str, sampling: str) -> None:
    p = _params(case, sampling)
    prompt = f"{PROMPTS[4]} {case}"
    expected = llm.generate([prompt], p)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True,
                                                  **SAMPLING[sampling]))[0]
    assert expected.token_ids != plain.token_ids  # the parameters change the output
    kwargs = dict(max_tokens=20, ignore_eos=True, timeout=TIMEOUT_S, **SAMPLING[sampling],
                  **CASES[case])
    with Client(cluster.address) as disaggregated:
        got = disaggregated.complete(prompt, **kwargs)
    assert list(got.token_ids) == expected.token_ids
    assert got.text == expected.text
    assert list(colocated.complete(prompt, **kwargs).token_ids) == expected.token_ids
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    bias = {str(k): v for k, v in CASES[case].get("logit_bias", {}).items()}
    extra = {k: v for k, v in CASES[case].items()
             if k not in ("logit_bias", "presence_penalty", "frequency_penalty")}
    standard = {k: v for k, v in CASES[case].items()
                if k in ("presence_penalty", "frequency_penalty")}
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        http = oai.completions.create(model="", prompt=prompt, max_tokens=20,
                                      extra_body={"ignore_eos": True, **extra},
                                      **({"logit_bias": bias} if bias else {}),
                                      **SAMPLING[sampling], **standard)
        assert http.choices[0].text == expected.text
        chat = oai.chat.completions.create(
            model="", messages=[{"role": "user", "content": prompt}], max_tokens=20,
            extra_body={"ignore_eos": True, **extra}, **({"logit_bias": bias} if bias else {}),
            **SAMPLING[sampling], **standard)
        assert chat.choices[0].message.content  # the chat path takes the same parameters
        assert chat.usage is not None and chat.usage.completion_tokens == 20


def test_out_of_range_values_are_a_400_naming_the_field(cluster: Cluster) -> None:
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        for kwargs, field in (({"presence_penalty": 3.0}, "presence_penalty"),
                              ({"logit_bias": {"999999": 1}}, "logit_bias"),
                              ({"extra_body": {"min_tokens": 50}}, "min_tokens")):
            with pytest.raises(openai.BadRequestError) as info:
                oai.completions.create(model="", prompt="hi", max_tokens=10, **kwargs)
            assert field in info.value.message


def _assert_logprobs_match(got: Any, expected: Any) -> None:
    """The SDK's logprobs equal ``engine.LLM``'s: same tokens, ranks and alternatives,
    values within 1e-4 (fp32, other batch shapes)."""
    assert list(got.token_ids) == expected.token_ids
    assert len(got.logprobs) == len(expected.logprobs) == len(expected.token_ids)
    for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
        assert (mine.token_id, mine.rank) == (theirs.token_id, theirs.rank)
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top], abs=1e-4)


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_logprobs_are_one_answer_everywhere(cluster: Cluster, colocated: Client, llm: LLM,
                                            sampling: str) -> None:
    """The first token's logprobs come from the prefill worker (with its Prefill reply),
    the rest from the decode worker: together they equal the engine's, and the colocated
    cluster's; the HTTP API carries the same values in OpenAI's two shapes."""
    prompt = f"{PROMPTS[3]} logprobs"
    knobs = dict(max_tokens=12, ignore_eos=True, presence_penalty=1.0, **SAMPLING[sampling])
    expected = llm.generate([prompt], SamplingParams(logprobs=4, **knobs))[0]  # type: ignore[arg-type]
    with Client(cluster.address) as disaggregated:
        _assert_logprobs_match(disaggregated.complete(prompt, logprobs=4, timeout=TIMEOUT_S,
                                                      **knobs), expected)  # type: ignore[arg-type]
    _assert_logprobs_match(colocated.complete(prompt, logprobs=4, timeout=TIMEOUT_S,
                                              **knobs), expected)  # type: ignore[arg-type]
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        http = oai.completions.create(model="", prompt=prompt, max_tokens=12, logprobs=4,
                                      presence_penalty=1.0, extra_body={"ignore_eos": True},
                                      **SAMPLING[sampling])
        legacy = http.choices[0].logprobs
        assert legacy is not None and legacy.token_logprobs is not None
        assert legacy.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs],
                                                      abs=1e-4)
        assert legacy.tokens is not None and len(legacy.tokens) == 12
        assert legacy.top_logprobs is not None  # strings as keys: equal ones collide
        assert all(1 <= len(top) <= 5 and token in top
                   for top, token in zip(legacy.top_logprobs, legacy.tokens, strict=True))
        for stream in (False, True):
            chat = oai.chat.completions.create(
                model="", messages=[{"role": "user", "content": prompt}], max_tokens=12,
                logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
                temperature=0.0, stream=stream)
            if stream:
                entries = [e for chunk in chat for choice in chunk.choices  # type: ignore[union-attr]
                           if choice.logprobs is not None for e in choice.logprobs.content or ()]
            else:
                content = chat.choices[0].logprobs  # type: ignore[union-attr]
                assert content is not None
                entries = list(content.content or ())
            assert len(entries) == 12
            for entry in entries:  # greedy: the sampled token is the likeliest
                assert len(entry.top_logprobs) == 3
                assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
                assert entry.bytes == list(entry.token.encode())


def test_bad_logprobs_are_a_400_naming_the_field(cluster: Cluster) -> None:
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        for kwargs, field in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                              ({"top_logprobs": 2}, "top_logprobs")):
            with pytest.raises(openai.BadRequestError) as info:
                oai.chat.completions.create(model="", messages=[{"role": "user",
                                                                 "content": "hi"}],
                                            max_tokens=4, **kwargs)
            assert field in info.value.message
        for value in (-1, 21):
            with pytest.raises(openai.BadRequestError) as info:
                oai.completions.create(model="", prompt="hi", max_tokens=4, logprobs=value)
            assert "logprobs" in info.value.message
    with Client(cluster.address) as client, pytest.raises(PdserveError) as refused:
        client.complete("hi", max_tokens=4, logprobs=21, timeout=TIMEOUT_S)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs" in refused.value.details



def _assert_same(got: Any, expected: Any) -> None:
    """Two lists of logprobs agree: tokens, ranks, alternatives; values within 1e-4."""
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert (mine.token_id, mine.rank) == (theirs.token_id, theirs.rank)
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_prompt_logprobs_and_echo_are_one_answer_everywhere(
        cluster: Cluster, colocated: Client, llm: LLM) -> None:
    """The prompt's logprobs are computed where the prompt runs (the prefill worker, or
    the decode worker colocated), never from the prefix cache (the prompt ran before):
    both equal the engine's; the HTTP API shows them as vLLM does (``prompt_logprobs``)
    and, with ``echo`` and ``logprobs``, in the legacy object after the prompt's text."""
    prompt = f"{PROMPTS[2]} echo"
    knobs: dict[str, Any] = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], SamplingParams(prompt_logprobs=2, logprobs=2, **knobs))[0]
    assert expected.prompt_logprobs is not None and expected.logprobs is not None
    with Client(cluster.address) as disaggregated:
        disaggregated.complete(prompt, timeout=TIMEOUT_S, **knobs)  # cached on both sides
        for client in (disaggregated, colocated):
            got = client.complete(prompt, prompt_logprobs=2, timeout=TIMEOUT_S, **knobs)
            assert list(got.token_ids) == expected.token_ids
            _assert_same(got.prompt_logprobs, expected.prompt_logprobs)
            chunks = list(client.generate(prompt, prompt_logprobs=2, timeout=TIMEOUT_S, **knobs))
            assert len(chunks[0].prompt_logprobs) == len(expected.prompt_token_ids) - 1
            assert all(not c.prompt_logprobs for c in chunks[1:])
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        http = oai.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0.0,
                                      echo=True, logprobs=2, extra_body={"ignore_eos": True})
        choice = http.choices[0]
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        legacy = choice.logprobs
        assert legacy is not None and legacy.token_logprobs is not None
        num_prompt = len(expected.prompt_token_ids)
        assert len(legacy.token_logprobs) == num_prompt + 5 and legacy.token_logprobs[0] is None
        assert legacy.token_logprobs[1:] == pytest.approx(
            [lp.logprob for lp in [*expected.prompt_logprobs, *expected.logprobs]], abs=1e-4)
        assert legacy.text_offset is not None and legacy.text_offset[0] == 0
        streamed = list(oai.completions.create(model="", prompt=prompt, max_tokens=5,
                                               temperature=0.0, echo=True, stream=True,
                                               extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
        assert streamed[0].choices[0].text.startswith(prompt)
        vllm = oai.completions.create(model="", prompt=prompt, max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True, "prompt_logprobs": 1})
        shown = vllm.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
        assert shown[0] is None and len(shown) == num_prompt
        for entry, lp in zip(shown[1:], expected.prompt_logprobs, strict=True):
            assert entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert entry[str(lp.token_id)]["rank"] == lp.rank
        chat = oai.chat.completions.create(
            model="", messages=[{"role": "user", "content": prompt}], max_tokens=3,
            extra_body={"prompt_logprobs": 0})
        assert chat.model_extra is not None and chat.model_extra["prompt_logprobs"][0] is None
        for extra in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):
            with pytest.raises(openai.BadRequestError) as info:
                oai.completions.create(model="", prompt="hi", max_tokens=2,
                                       extra_body=extra)  # type: ignore[arg-type]
            assert "prompt_logprobs" in info.value.message
    cluster.assert_no_leaks()

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "mood": {"enum": ["calm", "busy"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "mood", "n"], "additionalProperties": False}


def test_structured_outputs_are_one_answer_everywhere(cluster: Cluster, colocated: Client,
                                                      llm: LLM) -> None:
    """The prefill worker constrains the first token, the decode worker the rest (its
    matcher advanced over the first): seeded at temperature 1 on the random model, the
    output validates, stops inside max_tokens, and equals the colocated and the engine's;
    the HTTP API takes OpenAI's response_format and vLLM's guided_choice."""
    import jsonschema

    prompt = f"{PROMPTS[2]} json"
    knobs: dict[str, Any] = dict(max_tokens=80, temperature=1.0, seed=23)
    expected = llm.generate([prompt], SamplingParams(
        structured=StructuredOutput("json", json.dumps(SCHEMA)), **knobs))[0]
    assert expected.finish_reason == "stop"
    jsonschema.validate(json.loads(expected.text), SCHEMA)
    with Client(cluster.address) as disaggregated:
        got = disaggregated.complete(prompt, structured_outputs={"json": SCHEMA},
                                     timeout=TIMEOUT_S, **knobs)
    assert (list(got.token_ids), got.text, got.finish_reason) == (
        expected.token_ids, expected.text, "stop")
    assert list(colocated.complete(prompt, structured_outputs={"json": SCHEMA},
                                   timeout=TIMEOUT_S, **knobs).token_ids) == expected.token_ids
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        chat = oai.chat.completions.create(
            model="", messages=[{"role": "user", "content": prompt}], max_tokens=80,
            temperature=1.0, seed=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                       "strict": True}})
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SCHEMA)
        choice = oai.completions.create(model="", prompt=prompt, max_tokens=10,
                                        extra_body={"guided_choice": ["left", "right"]})
        assert choice.choices[0].text in ("left", "right")
        for extra, field in (({"structured_outputs": {"regex": "(("}}, "unclosed group"),
                             ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
                             ({"response_format": {"type": "yaml"}}, "response_format")):
            with pytest.raises(openai.BadRequestError) as info:
                oai.completions.create(model="", prompt="hi", max_tokens=4, extra_body=extra)
            assert field in info.value.message
    with Client(cluster.address) as client, pytest.raises(PdserveError) as refused:
        client.complete("hi", structured_outputs={"json": '{"type": "nope"}'},
                        timeout=TIMEOUT_S)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "nope" in refused.value.details


def test_n_choices_each_reproducible_and_the_prompt_counted_once(cluster: Cluster,
                                                                  llm: LLM) -> None:
    """n seeded choices: choice i is the engine's answer with seed + i (choice 0: the n = 1
    answer), the usage counts the prompt once; the same through the openai SDK (streamed
    and not); n over --max-n is refused naming it."""
    prompt = f"{PROMPTS[1]} choices"
    knobs: dict[str, Any] = dict(max_tokens=10, temperature=0.8, ignore_eos=True)
    expected = [llm.generate([prompt], SamplingParams(seed=40 + i, **knobs))[0]
                for i in range(3)]
    assert len({tuple(e.token_ids) for e in expected}) == 3  # the choices differ
    assert cluster.router is not None
    http_address = cluster.router.ready["http_address"]
    before = scrape_metrics(http_address)
    with Client(cluster.address) as client:
        got = client.complete(prompt, n=3, seed=40, timeout=TIMEOUT_S, **knobs)
        after = scrape_metrics(http_address)  # one request, its prompt once, every token
        for name, moved in (("pdserve:router_requests_total{finish_reason=length,status=OK}", 1),
                            ("pdserve:router_prompt_tokens_total{}", got.usage.prompt_tokens),
                            ("pdserve:router_generation_tokens_total{}", 30)):
            assert after[name] - before.get(name, 0.0) == moved, name
        assert [list(c.token_ids) for c in got.choices] == [e.token_ids for e in expected]
        assert list(got.token_ids) == expected[0].token_ids
        assert got.usage.prompt_tokens == len(expected[0].prompt_token_ids)
        assert got.usage.completion_tokens == 30
        indexes = [chunk.index for chunk in client.generate(prompt, n=2, seed=40,
                                                            timeout=TIMEOUT_S, **knobs)]
        assert sorted(set(indexes)) == [0, 1]
        with pytest.raises(PdserveError) as refused:
            client.complete(prompt, n=17, timeout=TIMEOUT_S)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-n" in refused.value.details
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        http = oai.completions.create(model="", prompt=prompt, n=3, seed=40, max_tokens=10,
                                      temperature=0.8, extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(http.choices, key=lambda c: c.index)] == [
            e.text for e in expected]
        assert http.usage is not None and http.usage.completion_tokens == 30
        stream = oai.chat.completions.create(
            model="", messages=[{"role": "user", "content": prompt}], n=2, max_tokens=6,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        texts: dict[int, str] = {}
        for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        assert sorted(texts) == [0, 1] and texts[0] == texts[1]  # greedy: the same twice
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model="", prompt="hi", n=17, max_tokens=2)
        assert "--max-n" in info.value.message
