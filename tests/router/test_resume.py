"""Resume tokens (``router.resume``): a stream's cursor seals each message's position;
``check`` accepts exactly the request and the tokens a token sealed, under the cluster's
key (any key of a rotation), and nothing made up."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from router.resume import TOKEN_BYTES, ResumeSeal, key_from_cluster_token, request_digest
from router.validation import ClientRequest, InvalidRequest, ModelLimits, ValidRequest, validate

KEY, OTHER = b"k" * 32, b"o" * 32
REQUEST = ValidRequest("r", (5, 6, 7), SamplingParams(max_tokens=8, temperature=0.5, seed=3))
OUTPUT = [[10, 11], [12], [13, 14]]


def _tokens(seal: ResumeSeal) -> list[tuple[list[int], bytes]]:
    """(tokens so far, the token after them) for each message of ``OUTPUT``."""
    cursor, sent, out = seal.cursor(REQUEST), [], []
    for ids in OUTPUT:
        assert cursor.offset == len(sent)
        sent = sent + ids
        out.append((sent, cursor.advance(ids)))
    return out


def test_every_message_s_token_resumes_after_its_tokens_only() -> None:
    seal = ResumeSeal([KEY])
    sealed = _tokens(seal)
    assert len({token for _, token in sealed}) == len(sealed)
    assert all(len(token) == TOKEN_BYTES for _, token in sealed)
    for sent, token in sealed:
        seal.check(REQUEST, token, sent)  # accepted
        for wrong in (sent[:-1], [*sent[:-1], sent[-1] + 1], [*sent, 1]):
            with pytest.raises(InvalidRequest, match="does not seal"):
                seal.check(REQUEST, token, wrong)
    # a cursor that starts after resumed tokens seals as one that streamed them
    sent, token = sealed[0]
    resumed = seal.cursor(REQUEST, sent)
    assert resumed.offset == len(sent)
    assert resumed.advance(OUTPUT[1]) == sealed[1][1]


def test_a_token_is_bound_to_the_request_and_the_key() -> None:
    sent, token = _tokens(ResumeSeal([KEY]))[1]
    other_request = ValidRequest("r", REQUEST.prompt_token_ids,
                                 SamplingParams(max_tokens=8, temperature=0.5, seed=4))
    assert request_digest(other_request) != request_digest(REQUEST)
    same_but_id = ValidRequest("another id", REQUEST.prompt_token_ids, REQUEST.sampling)
    assert request_digest(same_but_id) == request_digest(REQUEST)  # ids are not identity
    with pytest.raises(InvalidRequest, match="does not seal"):
        ResumeSeal([KEY]).check(other_request, token, sent)
    with pytest.raises(InvalidRequest, match="does not seal"):
        ResumeSeal([OTHER]).check(REQUEST, token, sent)
    ResumeSeal([OTHER, KEY]).check(REQUEST, token, sent)  # rotation: the old key still works
    with pytest.raises(InvalidRequest, match="16-byte"):
        ResumeSeal([KEY]).check(REQUEST, token[:8], sent)
    with pytest.raises(InvalidRequest, match="was whole"):
        ResumeSeal([KEY]).check(REQUEST, token, list(range(8)))


def test_keys_come_from_the_cluster_token_or_chance() -> None:
    key = key_from_cluster_token("s3cret-token")
    assert key == key_from_cluster_token("s3cret-token") and len(key) == 32
    assert b"s3cret" not in key and key != key_from_cluster_token("another")
    sent, token = _tokens(ResumeSeal([]))[0]  # a process's own random key
    with pytest.raises(InvalidRequest):
        ResumeSeal([]).check(REQUEST, token, sent)


LIMITS = ModelLimits("m", context_length=64, vocab_size=100, eos_token_ids=(2,))


class _Tokenizer:
    def encode(self, text: str) -> object:  # the prompt is given as token ids below
        raise AssertionError("not tokenized")


@pytest.mark.parametrize(("token", "token_ids", "message"), [
    (None, (1, 2), "without resume.token"),
    (b"t" * 16, (1, 200), "resumed token id 200 at position 1 is outside"),
    (b"t" * 16, tuple(range(8)), "fewer"),
])
def test_resume_fields_are_validated_before_any_work(token: bytes | None,
                                                     token_ids: tuple[int, ...],
                                                     message: str) -> None:
    client = ClientRequest(token_ids=(5, 6), max_tokens=8, resume_token=token,
                           resume_token_ids=token_ids)
    with pytest.raises(InvalidRequest, match=message):
        validate(client, LIMITS, _Tokenizer())  # type: ignore[arg-type]


def test_a_seal_takes_up_a_new_key_and_keeps_accepting_the_old() -> None:
    own = ResumeSeal([KEY])
    sent, token = _tokens(own)[0]
    shared = own.with_key(OTHER)
    shared.check(REQUEST, token, sent)  # sealed before the switch
    sent, token = _tokens(shared)[0]
    ResumeSeal([OTHER]).check(REQUEST, token, sent)  # sealed after: the shared key's

