"""Checking a client's request before any work: every "Bad input" row of RELIABILITY.md
(``../shared/RELIABILITY.md`` beside the repository).

Torch-free and protobuf-free: ``router.api`` turns the public message into a
``ClientRequest``; ``validate`` turns that into a ``ValidRequest`` (token ids, engine
sampling parameters, block hashes) or raises ``InvalidRequest`` with a message that names
the limit. Nothing is allocated anywhere before a request passes.
"""

from __future__ import annotations

import json
import math
import re
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from engine.config import load_model_config
from engine.grammar import GrammarError, Grammars
from engine.kvcache.block_hash import BlockHash, compute_block_hashes
from engine.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    StructuredOutput,
)
from engine.text.tokenizer import TokenizerInfo, load_tokenizer
from engine.tp.sharding import num_blocks_for

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
DEFAULT_MAX_TOKENS = 16


class InvalidRequest(ValueError):
    """The request breaks a limit; the message names it (becomes INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ModelLimits:
    """What the router knows of the served model (read from its directory, no weights)."""

    name: str
    context_length: int
    vocab_size: int  # the model's embedding rows: token ids must be below this
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, name: str | None = None,
                       tokenizer: TokenizerInfo | None = None) -> ModelLimits:
        """Limits from ``config.json`` (and the EOS ids of ``tokenizer``, loaded from the
        directory when not given)."""
        config = load_model_config(model_dir)
        eos = (tokenizer or load_tokenizer(model_dir)).eos_token_ids
        return cls(name=name or Path(model_dir).resolve().name,
                   context_length=config.max_model_len, vocab_size=config.vocab_size,
                   eos_token_ids=eos)


def load_router_tokenizer(model_dir: str | Path) -> tokenizers.Tokenizer:
    """The model's ``tokenizers.Tokenizer`` (``FileNotFoundError`` without tokenizer.json)."""
    return load_tokenizer(model_dir).tokenizer


@dataclass(frozen=True)
class ClientRequest:
    """A client's request as sent; ``None`` means "not given" (the default applies)."""

    request_id: str = ""
    model: str = ""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # None: off; else alternatives per token (0..20)
    prompt_logprobs: int | None = None  # None: off; else the prompt's, alternatives (0..20)
    structured: tuple[str, str] | None = None  # (kind, spec) of StructuredOutput; None: free
    n: int | None = None  # choices (None: 1)
    unknown_fields: tuple[int, ...] = ()  # field numbers this API does not define
    resume_token: bytes | None = None  # a broken stream's resume (``router.resume``)
    resume_token_ids: tuple[int, ...] = ()  # what the client received of it


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed every check. ``resumed``: the tokens a resumed stream's
    client has (checked against ``resume_token`` by ``router.resume`` before admission);
    the stream goes on after them."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    resume_token: bytes | None = None
    resumed: tuple[int, ...] = ()
    n: int = 1  # choices: choice i is sampled with seed + i (``router.parallel``)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def num_blocks(self, block_size: int) -> int:
        """KV blocks the whole sequence can need: prompt + max_tokens, rounded up."""
        return num_blocks_for(self.num_prompt_tokens + self.sampling.max_tokens, block_size)

    def block_hashes(self, block_size: int, hash_seed: int) -> list[BlockHash]:
        """The prefix-cache keys of the prompt's full blocks, as the workers compute them."""
        return compute_block_hashes(self.prompt_token_ids, block_size, seed=hash_seed)


def validate(request: ClientRequest, limits: ModelLimits,
             tokenizer: tokenizers.Tokenizer, grammars: Grammars | None = None) -> ValidRequest:
    """``ValidRequest`` for ``request`` or ``InvalidRequest`` naming what is wrong (a
    structured output is compiled with ``grammars``, as the workers will: refused here
    with the library's message; None: not checked)."""
    if request.unknown_fields:
        raise InvalidRequest(f"fields {list(request.unknown_fields)} are not part of the "
                             "public API (internal fields cannot be set by clients)")
    request_id = _request_id(request.request_id)
    if request.model and request.model != limits.name:
        raise InvalidRequest(f"unknown model {request.model!r}; this cluster serves "
                             f"{limits.name!r}")
    token_ids = _prompt_token_ids(request, limits, tokenizer)
    sampling = _sampling(request, limits)
    if sampling.structured is not None and grammars is not None:
        try:
            grammars.grammar(sampling.structured)
        except GrammarError as exc:
            raise InvalidRequest(str(exc)) from None
    total = len(token_ids) + sampling.max_tokens
    if total > limits.context_length:
        raise InvalidRequest(f"prompt ({len(token_ids)} tokens) + max_tokens "
                             f"({sampling.max_tokens}) = {total} is over the context length "
                             f"{limits.context_length}")
    n = 1 if request.n is None else request.n
    if n < 1:
        raise InvalidRequest(f"n must be at least 1, got {n}")
    if request.resume_token is None:
        if request.resume_token_ids:
            raise InvalidRequest("resume.token_ids without resume.token")
        return ValidRequest(request_id, token_ids, sampling, n=n)
    if n != 1:
        raise InvalidRequest("a stream of n > 1 choices cannot be resumed (its messages carry "
                             "no resume token)")
    if len(request.resume_token_ids) >= sampling.max_tokens:  # counted before checked
        raise InvalidRequest(f"resume.token_ids holds {len(request.resume_token_ids)} "
                             f"tokens; a stream of max_tokens={sampling.max_tokens} that "
                             "was not whole has fewer")
    check_vocab("resumed token id", request.resume_token_ids, limits.vocab_size)
    return ValidRequest(request_id, token_ids, sampling, request.resume_token,
                        request.resume_token_ids)


def _request_id(request_id: str) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if not REQUEST_ID_RE.fullmatch(request_id):
        raise InvalidRequest(f"request_id must be 1..128 characters from [A-Za-z0-9._:-], "
                             f"got {json.dumps(request_id[:40])}")
    return request_id


def _prompt_token_ids(request: ClientRequest, limits: ModelLimits,
                      tokenizer: tokenizers.Tokenizer) -> tuple[int, ...]:
    if request.text is not None and request.token_ids is not None:
        raise InvalidRequest("give the prompt as text or as token ids, not both")
    if request.token_ids is not None:
        token_ids = request.token_ids
        _check_length(len(token_ids), limits)  # the cheap check first: then item by item
        check_vocab("prompt token id", token_ids, limits.vocab_size)
    else:
        text = request.text or ""
        if len(text) > 64 * limits.context_length:  # cheap bound before tokenizing
            raise InvalidRequest(f"prompt of {len(text)} characters cannot fit the context "
                                 f"length of {limits.context_length} tokens")
        token_ids = tuple(tokenizer.encode(text).ids) if text else ()
    _check_length(len(token_ids), limits)
    return token_ids


def _check_length(num_tokens: int, limits: ModelLimits) -> None:
    if not num_tokens:
        raise InvalidRequest("prompt is empty: give non-empty text or at least one token id")
    if num_tokens >= limits.context_length:
        raise InvalidRequest(f"prompt of {num_tokens} tokens leaves no room in the "
                             f"context length of {limits.context_length} tokens")


def _as_float32(name: str, value: float | None, default: float) -> float:
    """``value`` (``default`` if None) as the 32-bit float the internal API carries it as:
    validated as the workers will see it. ``InvalidRequest`` when not finite there."""
    if value is None:
        return default
    try:
        rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        rounded = math.inf
    if not math.isfinite(rounded):
        raise InvalidRequest(f"{name} must be finite (as a 32-bit float), got {value}")
    return rounded


def _sampling(request: ClientRequest, limits: ModelLimits) -> SamplingParams:
    max_tokens = DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    if max_tokens > limits.context_length:
        raise InvalidRequest(f"max_tokens must be at most the context length "
                             f"{limits.context_length}, got {max_tokens}")
    temperature, top_p, min_p, presence, frequency, repetition = (
        _as_float32(name, getattr(request, name), default) for name, default in (
            ("temperature", 1.0), ("top_p", 1.0), ("min_p", 0.0), ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)))
    if top_p == 0.0 and request.top_p:
        raise InvalidRequest(f"top_p must be in (0, 1], got {request.top_p} (0 as the 32-bit "
                             "float the workers use)")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # counted before checked one by one
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got "
                             f"{len(request.stop_token_ids)}")
    check_vocab("stop token id", request.stop_token_ids, limits.vocab_size)
    if len(request.logit_bias) > MAX_LOGIT_BIAS:  # counted before checked one by one
        raise InvalidRequest(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got "
                             f"{len(request.logit_bias)}")
    check_vocab("logit_bias token id", [t for t, _ in request.logit_bias], limits.vocab_size)
    bias = tuple((t, _as_float32("a logit_bias value", max(-LOGIT_BIAS_LIMIT, min(
        LOGIT_BIAS_LIMIT, b)) if b == b else b, 0.0)) for t, b in request.logit_bias)
    try:
        structured = None if request.structured is None else StructuredOutput(
            *request.structured)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature, top_p=top_p,
            # vLLM: 0 (or -1) considers every token
            top_k=-1 if request.top_k is None or request.top_k == 0 else request.top_k,
            seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos, min_p=min_p,
            min_tokens=0 if request.min_tokens is None else request.min_tokens,
            presence_penalty=presence, frequency_penalty=frequency,
            repetition_penalty=repetition, logit_bias=bias, logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs, structured=structured)
    except ValueError as exc:  # the engine's own limits, named in its message
        raise InvalidRequest(str(exc)) from None


def check_vocab(what: str, token_ids: Sequence[int], vocab_size: int) -> None:
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"{what} {token_id} at position {position} is outside the "
                                 f"vocabulary [0, {vocab_size})")
