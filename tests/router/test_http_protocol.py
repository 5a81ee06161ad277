"""The HTTP API's request bodies (router.http.protocol): what maps to a ClientRequest, what
is ignored, and what is refused with a 400 naming the parameter."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.http.errors import ApiError
from router.http.protocol import (
    INTERNAL_FIELDS,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)


def completion(**fields: Any) -> CompletionRequest:
    body = parse(CompletionRequest, json.dumps({"prompt": "hi", **fields}).encode())
    body.check_extras()
    return body


def refused(model: type[Any], **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        body = parse(model, json.dumps(fields).encode())
        body.check_extras()
        if isinstance(body, CompletionRequest):
            body.prompt_parts()
        else:
            body.template_messages()
    assert info.value.status == 400
    return info.value


def test_sampling_fields_map_to_the_client_request() -> None:
    body = completion(model="m", max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3,
                      stop="END", stop_token_ids=[2, 9], ignore_eos=True, user="someone",
                      stream=True, stream_options={"include_usage": True})
    text, ids = body.prompt_parts()
    client = body.client_request(request_id="r-1", max_tokens=body.max_tokens, text=text,
                                 token_ids=ids)
    assert (client.request_id, client.model, client.text, client.token_ids) == ("r-1", "m",
                                                                                "hi", None)
    assert (client.max_tokens, client.temperature, client.top_p, client.top_k, client.seed) == (
        7, 0.5, 0.9, 5, 3)
    assert client.stop == ("END",) and client.stop_token_ids == (2, 9) and client.ignore_eos
    assert body.stream and body.include_usage


def test_unset_fields_stay_unset_so_the_routers_defaults_apply() -> None:
    client = completion().client_request(request_id="", max_tokens=None, text="hi")
    assert (client.max_tokens, client.temperature, client.top_p, client.top_k,
            client.seed) == (None,) * 5
    assert client.stop == () and not client.ignore_eos


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", ("text", None)),
    ([5, 6, 7], (None, (5, 6, 7))),
    (["one text"], ("one text", None)),
    ([[8, 9]], (None, (8, 9))),
    ([], (None, ())),  # empty: the router's validation says "prompt is empty"
])
def test_prompt_as_text_or_token_ids(prompt: Any, expected: tuple[Any, Any]) -> None:
    assert completion(prompt=prompt).prompt_parts() == expected


def test_a_batch_of_prompts_is_refused() -> None:
    error = refused(CompletionRequest, prompt=["a", "b"])
    assert error.param == "prompt" and "batch of 2 prompts" in error.message


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_parameters_are_refused_unless_at_their_default(name: str) -> None:
    non_default: dict[str, Any] = {"n": 2, "best_of": 3, "logprobs": 1, "top_logprobs": 2,
                                   "prompt_logprobs": 1, "echo": True, "suffix": "x",
                                   "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                   "repetition_penalty": 1.2, "logit_bias": {"5": 10},
                                   "response_format": {"type": "json_object"},
                                   "tools": [{"type": "function"}], "tool_choice": "auto",
                                   "functions": [{"name": "f"}], "function_call": "auto",
                                   "min_p": 0.1, "min_tokens": 3, "use_beam_search": True,
                                   "guided_json": {}, "guided_regex": "a+",
                                   "guided_choice": ["a"], "guided_grammar": "g",
                                   "structured_outputs": {"json": {}},
                                   "include_stop_str_in_output": True,
                                   "skip_special_tokens": False,
                                   "spaces_between_special_tokens": False,
                                   "allowed_token_ids": [5], "bad_words": ["no"],
                                   "truncate_prompt_tokens": 8,
                                   "continue_final_message": True}
    error = refused(CompletionRequest, prompt="hi", **{name: non_default[name]})
    assert error.param == name and error.code == "unsupported_parameter"
    assert error.message.startswith(f"{name} is not supported by pdserve")
    assert completion(**{name: None}).model_extra == {name: None}  # null: not set
    for default in UNSUPPORTED[name]:
        completion(**{name: default})  # the default value passes


def test_true_is_not_the_default_one() -> None:
    assert refused(CompletionRequest, prompt="hi", n=True).param == "n"


@pytest.mark.parametrize("name", INTERNAL_FIELDS)
def test_internal_fields_are_refused(name: str) -> None:
    error = refused(CompletionRequest, prompt="hi", **{name: 1})
    assert error.param == name
    assert error.message == (f"fields ['{name}'] are not part of the public API (internal "
                             "fields cannot be set by clients)")


def test_other_unknown_fields_are_ignored() -> None:
    body = completion(some_future_field={"x": 1}, metadata={"k": "v"}, service_tier="auto")
    assert body.client_request(request_id="", max_tokens=None, text="hi").text == "hi"


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"stop": [1]}, "stop", "valid string"),
    ({"seed": -(1 << 63) - 1}, "seed", "greater than or equal to"),
    ({"seed": 1 << 64}, "seed", "less than or equal to"),
    ({"top_k": 1 << 40}, "top_k", "less than or equal to"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": {"text": "hi"}}, "prompt", "valid"),
])
def test_wrong_types_name_the_field(fields: dict[str, Any], param: str, says: str) -> None:
    error = refused(CompletionRequest, **{"prompt": "hi", **fields})
    assert error.param == param and error.message.startswith(param) and says in error.message


def test_a_body_that_is_not_json_or_not_an_object() -> None:
    for body in (b"{not json", b"[1, 2]", b""):
        with pytest.raises(ApiError) as info:
            parse(CompletionRequest, body)
        assert info.value.status == 400 and info.value.message.startswith("request body:")
    assert "prompt" in refused(CompletionRequest).message  # required


def test_stream_options_need_stream() -> None:
    error = refused(CompletionRequest, prompt="hi", stream_options={"include_usage": True})
    assert error.param == "stream_options"


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    body = parse(ChatCompletionRequest, json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "max_completion_tokens": 9}).encode())
    assert body.requested_max_tokens == 9
    body = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}], '
                                        b'"max_tokens": 5}')
    assert body.requested_max_tokens == 5


def test_chat_messages_reach_the_template_with_text_parts_joined() -> None:
    body = parse(ChatCompletionRequest, json.dumps({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one "},
                                     {"type": "text", "text": "two"}], "name": "ann"},
        {"role": "assistant", "content": None},
    ]}).encode())
    assert body.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one two", "name": "ann"},
        {"role": "assistant", "content": None},
    ]
    assert body.add_generation_prompt


def test_chat_refuses_non_text_parts_and_empty_conversations() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    error = refused(ChatCompletionRequest, messages=[{"role": "user", "content": [image]}])
    assert "messages[0].content[0]" in error.message and "image_url" in error.message
    assert refused(ChatCompletionRequest, messages=[]).param == "messages"
    assert refused(ChatCompletionRequest, messages=[{"content": "no role"}]).param == "messages"


def test_penalties_min_p_min_tokens_and_logit_bias_are_carried() -> None:
    body = completion(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
                      min_p=0.1, min_tokens=3, logit_bias={"5": 10, "7": -100})
    request = body.client_request(request_id="r", max_tokens=8, text="hi")
    assert (request.presence_penalty, request.frequency_penalty, request.repetition_penalty,
            request.min_p, request.min_tokens) == (0.5, -0.25, 1.2, 0.1, 3)
    assert request.logit_bias == ((5, 10.0), (7, -100.0))
    with pytest.raises(ApiError) as info:
        completion(logit_bias={"five": 1}).client_request(request_id="r", max_tokens=8,
                                                          text="hi")
    assert info.value.param == "logit_bias" and "token ids" in info.value.message


def test_logprobs_map_to_the_client_request_and_bad_ones_are_refused() -> None:
    assert completion(logprobs=3).client_request(request_id="r", max_tokens=4).logprobs == 3
    assert completion().client_request(request_id="r", max_tokens=4).logprobs is None

    def chat(**fields: Any) -> int | None:
        body = parse(ChatCompletionRequest, json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], **fields}).encode())
        return body.client_request(request_id="r", max_tokens=4).logprobs

    assert chat(logprobs=True, top_logprobs=5) == 5
    assert chat(logprobs=True) == 0
    assert chat(logprobs=False) is None
    for fields, param in (({"top_logprobs": 2}, "top_logprobs"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
        with pytest.raises(ApiError) as info:
            chat(**fields)
        assert info.value.param == param
    with pytest.raises(ApiError) as info:
        completion(logprobs=-1).client_request(request_id="r", max_tokens=4)
    assert info.value.param == "logprobs" and "[0, 20]" in info.value.message


def test_vllm_s_top_k_0_and_negative_seeds_are_taken() -> None:
    """As vLLM: top_k 0 considers every token (as -1), any int64 is a seed (a negative one
    as its unsigned 64-bit pattern, which the gRPC API carries)."""
    from router.validation import ModelLimits, validate

    limits = ModelLimits(name="m", context_length=64, vocab_size=100, eos_token_ids=(2,))
    client = completion(prompt=[5, 6], top_k=0, seed=-2).client_request(
        request_id="", max_tokens=4, text=None, token_ids=(5, 6))
    assert client.seed == (1 << 64) - 2
    sampling = validate(client, limits, None).sampling  # type: ignore[arg-type]
    assert sampling.top_k == -1 and sampling.seed == (1 << 64) - 2
    unseeded = completion(prompt=[5], seed=-1).client_request(
        request_id="", max_tokens=4, text=None, token_ids=(5,))
    assert unseeded.seed is None  # vLLM's -1


def test_vllm_extensions_pdserve_lacks_are_refused_where_they_would_change_the_output() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    error = refused(ChatCompletionRequest, **chat, echo=True)
    assert error.param == "echo" and error.code == "unsupported_parameter"
    parse(ChatCompletionRequest, json.dumps({**chat, "echo": False}).encode()).check_extras()
    error = refused(CompletionRequest, prompt="hi", stream=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert error.param == "stream_options" and "continuous_usage_stats" in error.message
