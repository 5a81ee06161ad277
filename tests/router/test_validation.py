"""router.validation and router.api: every "Bad input" row becomes InvalidRequest with a
message naming the limit; valid requests tokenize and hash as the workers do; the public
message is parsed from raw bytes, so encoding faults and foreign fields are caught too."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import tokenizers

from cluster.internal.v1 import worker_pb2
from engine.kvcache.block_hash import compute_block_hashes
from pdserve.v1 import generate_pb2 as pb
from router.api import parse_generate_request, to_response
from router.outputs import OutputChunk, Usage
from router.validation import (
    DEFAULT_MAX_TOKENS,
    REQUEST_ID_RE,
    ClientRequest,
    InvalidRequest,
    ModelLimits,
    ValidRequest,
    load_router_tokenizer,
    validate,
)
from tests.factories import PROMPTS

# Small limits make every boundary cheap to reach with token-id prompts.
SMALL = ModelLimits(name="tiny", context_length=32, vocab_size=100, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> tokenizers.Tokenizer:
    return load_router_tokenizer(llama_dir)


@pytest.fixture(scope="module")
def limits(llama_dir: Path) -> ModelLimits:
    return ModelLimits.from_model_dir(llama_dir, name="llama-tiny")


def _ids(n: int) -> tuple[int, ...]:
    return tuple(3 + i % 90 for i in range(n))


# (case id, request fields, substrings the message must contain)
BAD_INPUT: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("empty-text", {"text": ""}, ("empty",)),
    ("no-prompt", {}, ("empty",)),
    ("empty-token-list", {"token_ids": ()}, ("empty",)),
    ("text-and-token-ids", {"text": "hi", "token_ids": (5,)}, ("not both",)),
    ("prompt-at-context", {"token_ids": _ids(32)}, ("32 tokens", "context length of 32")),
    ("prompt-over-context", {"token_ids": _ids(33)}, ("33 tokens", "context length of 32")),
    ("text-over-char-bound", {"text": "a" * (64 * 32 + 1)}, ("2049 characters", "32")),
    ("prompt-plus-max-tokens", {"token_ids": _ids(20), "max_tokens": 13},
     ("(20 tokens)", "(13)", "= 33", "context length 32")),
    ("prompt-plus-default-max-tokens", {"token_ids": _ids(17)},
     ("(17 tokens)", f"({DEFAULT_MAX_TOKENS})", "= 33", "32")),
    ("max-tokens-zero", {"token_ids": _ids(4), "max_tokens": 0}, ("max_tokens", "positive", "0")),
    ("max-tokens-negative", {"token_ids": _ids(4), "max_tokens": -1}, ("max_tokens", "-1")),
    ("max-tokens-over-context", {"token_ids": _ids(4), "max_tokens": 33},
     ("max_tokens", "context length 32", "33")),
    ("max-tokens-absurd", {"token_ids": _ids(4), "max_tokens": 2**62},
     ("max_tokens", "32", str(2**62))),
    ("temperature-nan", {"token_ids": _ids(4), "temperature": math.nan},
     ("temperature", "finite", "nan")),
    ("temperature-inf", {"token_ids": _ids(4), "temperature": math.inf},
     ("temperature", "finite", "inf")),
    ("temperature-negative", {"token_ids": _ids(4), "temperature": -1.0},
     ("temperature", ">= 0", "-1")),
    ("top-p-zero", {"token_ids": _ids(4), "top_p": 0.0}, ("top_p", "(0, 1]", "0.0")),
    ("top-p-over-one", {"token_ids": _ids(4), "top_p": 1.5}, ("top_p", "(0, 1]", "1.5")),
    ("top-p-nan", {"token_ids": _ids(4), "top_p": math.nan}, ("top_p", "nan")),
    ("top-k-minus-two", {"token_ids": _ids(4), "top_k": -2}, ("top_k", "-1", ">= 1", "-2")),
    ("too-many-stop-strings", {"token_ids": _ids(4), "stop": tuple("abcdefghijklmnopq")},
     ("at most 16 stop strings", "17")),
    ("empty-stop-string", {"token_ids": _ids(4), "stop": ("ok", "")}, ("1..256",)),
    ("long-stop-string", {"token_ids": _ids(4), "stop": ("x" * 257,)}, ("1..256",)),
    ("token-id-negative", {"token_ids": (5, -1)},
     ("prompt token id -1", "position 1", "[0, 100)")),
    ("token-id-vocab-size", {"token_ids": (100,)}, ("prompt token id 100", "[0, 100)")),
    ("stop-token-id-out-of-vocab", {"token_ids": _ids(4), "stop_token_ids": (2, 100)},
     ("stop token id 100", "[0, 100)")),
    ("too-many-stop-token-ids", {"token_ids": _ids(4), "stop_token_ids": (1,) * 1025},
     ("at most 1024 stop_token_ids", "1025")),
    ("too-many-stop-token-ids-out-of-vocab", {"token_ids": _ids(4),
                                              "stop_token_ids": (10**6,) * 5000},
     ("at most 1024 stop_token_ids", "5000")),  # counted before each is checked
    ("stop-token-id-negative", {"token_ids": _ids(4), "stop_token_ids": (-3,)},
     ("stop token id -3", "[0, 100)")),
    ("unknown-model", {"token_ids": _ids(4), "model": "gpt-9"}, ("'gpt-9'", "'tiny'")),
    ("request-id-too-long", {"token_ids": _ids(4), "request_id": "r" * 129},
     ("1..128", "[A-Za-z0-9._:-]")),
    ("request-id-space", {"token_ids": _ids(4), "request_id": "a b"}, ("[A-Za-z0-9._:-]", '"a b"')),
    ("request-id-slash", {"token_ids": _ids(4), "request_id": "a/b"}, ("[A-Za-z0-9._:-]",)),
    ("request-id-newline", {"token_ids": _ids(4), "request_id": "a\nb"}, ("\"a\\nb\"",)),
    ("request-id-non-ascii", {"token_ids": _ids(4), "request_id": "réq"}, ("[A-Za-z0-9._:-]",)),
    ("unknown-fields", {"token_ids": _ids(4), "unknown_fields": (4, 99)},
     ("[4, 99]", "not part of the public API")),
    ("presence-penalty-over-2", {"token_ids": _ids(4), "presence_penalty": 2.5},
     ("presence_penalty", "[-2, 2]", "2.5")),
    ("frequency-penalty-nan", {"token_ids": _ids(4), "frequency_penalty": math.nan},
     ("frequency_penalty", "finite")),
    ("repetition-penalty-zero", {"token_ids": _ids(4), "repetition_penalty": 0.0},
     ("repetition_penalty", "> 0")),
    ("min-p-over-one", {"token_ids": _ids(4), "min_p": 1.5}, ("min_p", "[0, 1]")),
    ("min-tokens-over-max-tokens", {"token_ids": _ids(4), "max_tokens": 4, "min_tokens": 5},
     ("min_tokens", "max_tokens=4", "5")),
    ("min-tokens-negative", {"token_ids": _ids(4), "min_tokens": -1}, ("min_tokens", "-1")),
    ("logit-bias-out-of-vocab", {"token_ids": _ids(4), "logit_bias": ((5, 1.0), (100, 2.0))},
     ("logit_bias token id 100", "[0, 100)")),
    ("logit-bias-nan", {"token_ids": _ids(4), "logit_bias": ((5, math.nan),)},
     ("logit_bias value", "finite")),
    ("too-many-logit-biases", {"token_ids": _ids(4),
                               "logit_bias": tuple((10**6, 1.0) for _ in range(1025))},
     ("at most 1024 logit_bias entries", "1025")),
]


@pytest.mark.parametrize(("fields", "expected"), [c[1:] for c in BAD_INPUT],
                         ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_rejected_naming_the_limit(
        tokenizer: tokenizers.Tokenizer, fields: dict[str, Any], expected: tuple[str, ...]) -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        validate(ClientRequest(**fields), SMALL, tokenizer)
    message = str(excinfo.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_the_limits_themselves_are_accepted(tokenizer: tokenizers.Tokenizer) -> None:
    # Each boundary one step inside the BAD_INPUT cases above.
    ok = [
        ClientRequest(token_ids=_ids(31), max_tokens=1),  # prompt + max_tokens == context
        ClientRequest(token_ids=_ids(20), max_tokens=12),
        ClientRequest(token_ids=(0, 99), stop_token_ids=(0, 99)),
        ClientRequest(token_ids=_ids(4), temperature=0.0, top_p=1.0, top_k=1),
        ClientRequest(token_ids=_ids(4), top_p=1e-6, top_k=-1),
        ClientRequest(token_ids=_ids(4), stop=tuple("abcdefghijklmnop")),  # 16
        ClientRequest(token_ids=_ids(4), stop=("x" * 256,)),
        ClientRequest(token_ids=_ids(4), request_id="r" * 128),
        ClientRequest(token_ids=_ids(4), request_id="A-z_0.9:x"),
        ClientRequest(token_ids=_ids(4), model="tiny"),
    ]
    for request in ok:
        assert isinstance(validate(request, SMALL, tokenizer), ValidRequest), request


def test_defaults_apply_when_fields_are_absent(tokenizer: tokenizers.Tokenizer) -> None:
    valid = validate(ClientRequest(request_id="r1", token_ids=(7, 8, 9)), SMALL, tokenizer)
    assert valid.request_id == "r1"
    assert valid.prompt_token_ids == (7, 8, 9)
    s = valid.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k) == (16, 1.0, 1.0, -1)
    assert DEFAULT_MAX_TOKENS == 16
    assert (s.seed, s.stop, s.stop_token_ids, s.ignore_eos) == (None, (), (), False)


def test_given_fields_reach_the_sampling_params(tokenizer: tokenizers.Tokenizer) -> None:
    request = ClientRequest(token_ids=(7,), max_tokens=3, temperature=0.0, top_p=0.5,
                            top_k=4, seed=0, stop=("\n",), stop_token_ids=(9,), ignore_eos=True)
    s = validate(request, SMALL, tokenizer).sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (3, 0.0, 0.5, 4, 0)
    assert (s.stop, s.stop_token_ids, s.ignore_eos) == (("\n",), (9,), True)
    assert s.greedy


def test_empty_request_id_gets_a_unique_generated_one(tokenizer: tokenizers.Tokenizer) -> None:
    ids = {validate(ClientRequest(token_ids=(7,)), SMALL, tokenizer).request_id
           for _ in range(20)}
    assert len(ids) == 20
    assert all(REQUEST_ID_RE.fullmatch(i) for i in ids)


def test_text_prompts_tokenize_like_the_model_tokenizer(
        llama_dir: Path, tokenizer: tokenizers.Tokenizer, limits: ModelLimits) -> None:
    reference = tokenizers.Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    for text in PROMPTS:
        valid = validate(ClientRequest(text=text), limits, tokenizer)
        assert list(valid.prompt_token_ids) == reference.encode(text).ids, text
        assert valid.num_prompt_tokens == len(reference.encode(text).ids)


def test_limits_from_the_model_dir(llama_dir: Path, limits: ModelLimits) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    assert limits.name == "llama-tiny"
    assert ModelLimits.from_model_dir(llama_dir).name == llama_dir.resolve().name
    assert limits.vocab_size == config["vocab_size"]
    assert limits.context_length > 0 and limits.eos_token_ids


def test_token_ids_are_checked_against_the_model_vocab(
        tokenizer: tokenizers.Tokenizer, limits: ModelLimits) -> None:
    top = limits.vocab_size - 1
    assert validate(ClientRequest(token_ids=(top,)), limits, tokenizer).prompt_token_ids == (top,)
    with pytest.raises(InvalidRequest, match=rf"\[0, {limits.vocab_size}\)"):
        validate(ClientRequest(token_ids=(limits.vocab_size,)), limits, tokenizer)


def test_real_context_length_is_enforced(
        tokenizer: tokenizers.Tokenizer, limits: ModelLimits) -> None:
    n = limits.context_length
    with pytest.raises(InvalidRequest, match=f"context length of {n}"):
        validate(ClientRequest(token_ids=(5,) * n), limits, tokenizer)
    with pytest.raises(InvalidRequest, match=f"= {n + 1} is over the context length {n}"):
        validate(ClientRequest(token_ids=(5,) * (n - 1), max_tokens=2), limits, tokenizer)


@pytest.mark.parametrize(("num_prompt", "max_tokens", "block_size", "blocks"), [
    (5, 11, 16, 1),  # 16 tokens: exactly one block
    (5, 12, 16, 2),  # 17: rounds up
    (1, 1, 16, 1),
    (16, 16, 4, 8),
    (17, 1, 4, 5),
])
def test_num_blocks_rounds_prompt_plus_max_tokens_up(
        tokenizer: tokenizers.Tokenizer, num_prompt: int, max_tokens: int,
        block_size: int, blocks: int) -> None:
    valid = validate(ClientRequest(token_ids=_ids(num_prompt), max_tokens=max_tokens),
                     SMALL, tokenizer)
    assert valid.num_blocks(block_size) == blocks


def test_block_hashes_are_the_workers_block_hashes(tokenizer: tokenizers.Tokenizer) -> None:
    tokens = _ids(11)
    valid = validate(ClientRequest(token_ids=tokens, max_tokens=4), SMALL, tokenizer)
    hashes = valid.block_hashes(4, hash_seed=7)
    assert hashes == compute_block_hashes(tokens, 4, seed=7)
    assert len(hashes) == 2
    assert valid.block_hashes(4, hash_seed=8) != hashes


# --- router.api: the public message from raw bytes ------------------------------------


def _reject_raw(raw: bytes) -> str:
    with pytest.raises(InvalidRequest) as excinfo:
        parse_generate_request(raw)
    return str(excinfo.value)


def test_invalid_utf8_text_is_rejected_naming_utf8() -> None:
    raw = bytes([0x1A, 2]) + b"\xff\xfe"  # field 3 (text), wire type 2, length 2
    assert "UTF-8" in _reject_raw(raw)


@pytest.mark.parametrize("raw", [b"\xff\xff\xff", b"\x0a\x05ab", b"\x2a\x09\x08"],
                         ids=["bad-tag", "truncated-string", "truncated-submessage"])
def test_garbage_bytes_are_rejected(raw: bytes) -> None:
    assert "not a valid pdserve.v1.GenerateRequest" in _reject_raw(raw)


def test_an_internal_message_is_rejected_naming_its_field(
        tokenizer: tokenizers.Tokenizer) -> None:
    raw = worker_pb2.ReserveRequest(transfer_id=7).SerializeToString()
    request = parse_generate_request(raw)
    assert 4 in request.unknown_fields
    with pytest.raises(InvalidRequest, match=r"\[4\]"):
        validate(request, SMALL, tokenizer)


def test_unknown_fields_anywhere_are_rejected(tokenizer: tokenizers.Tokenizer) -> None:
    base = pb.GenerateRequest(text="hi").SerializeToString()
    top_level = base + bytes([0x98, 0x06, 0x01])  # field 99, varint 1
    assert parse_generate_request(top_level).unknown_fields == (99,)
    in_sampling = base + bytes([0x2A, 3, 0xA0, 0x01, 0x01])  # sampling { field 20: 1 }
    assert parse_generate_request(in_sampling).unknown_fields == (20,)
    for raw, number in ((top_level, "99"), (in_sampling, "20")):
        with pytest.raises(InvalidRequest, match=number):
            validate(parse_generate_request(raw), SMALL, tokenizer)


def test_absent_optional_fields_are_none() -> None:
    request = parse_generate_request(pb.GenerateRequest(text="hi").SerializeToString())
    assert request.text == "hi" and request.token_ids is None
    assert (request.max_tokens, request.temperature, request.top_p, request.top_k,
            request.seed) == (None, None, None, None, None)
    assert request.unknown_fields == ()
    assert parse_generate_request(b"") == ClientRequest()


def test_present_zero_values_are_zero_not_none(tokenizer: tokenizers.Tokenizer) -> None:
    message = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5]),
        sampling=pb.SamplingParams(temperature=0.0, seed=0, top_k=0, max_tokens=0, top_p=0.0))
    request = parse_generate_request(message.SerializeToString())
    assert (request.temperature, request.seed, request.top_k, request.max_tokens,
            request.top_p) == (0.0, 0, 0, 0, 0.0)
    greedy = parse_generate_request(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5]),
        sampling=pb.SamplingParams(temperature=0.0, seed=0)).SerializeToString())
    s = validate(greedy, SMALL, tokenizer).sampling
    assert (s.temperature, s.seed) == (0.0, 0)


def test_an_empty_token_list_is_given_not_absent(tokenizer: tokenizers.Tokenizer) -> None:
    raw = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])).SerializeToString()
    request = parse_generate_request(raw)
    assert request.token_ids == () and request.text is None
    with pytest.raises(InvalidRequest, match="empty"):
        validate(request, SMALL, tokenizer)


def test_a_full_request_parses_and_validates(tokenizer: tokenizers.Tokenizer) -> None:
    message = pb.GenerateRequest(
        request_id="req-1", model="tiny", token_ids=pb.TokenIds(ids=[5, 6, 7]),
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.5, top_p=0.5, top_k=3,
                                   seed=2**64 - 1, stop=["END"], stop_token_ids=[9],
                                   ignore_eos=True))
    valid = validate(parse_generate_request(message.SerializeToString()), SMALL, tokenizer)
    assert (valid.request_id, valid.prompt_token_ids) == ("req-1", (5, 6, 7))
    s = valid.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k) == (4, 0.5, 0.5, 3)
    assert (s.seed, s.stop, s.stop_token_ids, s.ignore_eos) == (2**64 - 1, ("END",), (9,), True)


def test_to_response_sets_usage_only_on_the_last_chunk() -> None:
    middle = to_response("r", OutputChunk(token_ids=(5, 6), text="ab"))
    assert (list(middle.token_ids), middle.text, middle.finish_reason) == ([5, 6], "ab", "")
    assert not middle.HasField("usage")
    last = to_response("r", OutputChunk(token_ids=(7,), text="c", finish_reason="length",
                                        usage=Usage(prompt_tokens=3, completion_tokens=3,
                                                    cached_tokens=2)))
    assert (last.request_id, last.finish_reason) == ("r", "length")
    assert last.HasField("usage")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens,
            last.usage.cached_tokens) == (3, 3, 2)


def test_the_admission_bound_of_a_prompt_is_capped_at_the_context() -> None:
    """A token-id prompt longer than the context is refused by validation (400), never by
    the queued-token budget (a 429 the client would retry for ever)."""
    from router.core import token_bound

    assert token_bound(ClientRequest(token_ids=tuple(range(5, 100_005))), SMALL) == \
        SMALL.context_length
    assert token_bound(ClientRequest(token_ids=(5, 6)), SMALL) == 2
    assert token_bound(ClientRequest(text="x" * 10_000), SMALL) == SMALL.context_length
