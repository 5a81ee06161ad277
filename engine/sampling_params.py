"""Per-request sampling parameters, named as vLLM names them. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (vLLM's max_logprobs)
LOGIT_BIAS_LIMIT = 100.0  # a bias is clamped to [-100, 100], as OpenAI's API does
MAX_PENALTY = 2.0  # presence and frequency penalties are in [-2, 2], as OpenAI's
GREEDY_BELOW = 1e-5
"""A temperature below this is greedy (as vLLM's sampler treats it): dividing logits by a
tiny positive temperature overflows to inf and NaN."""


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 64 * 1024  # a schema, regex or grammar, as text


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (vLLM's ``structured_outputs``): ``kind`` ``"json"`` (a
    JSON Schema, as JSON text), ``"json_object"`` (any JSON object; ``spec`` empty),
    ``"regex"``, ``"choice"`` (a JSON list of strings: exactly one of them) or
    ``"grammar"`` (a Lark grammar). Compiled and enforced by ``engine.grammar``."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {list(STRUCTURED_KINDS)}, "
                             f"got {self.kind!r:.40}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_STRUCTURED_CHARS:
            raise ValueError(f"a structured output's {self.kind} must be text of at most "
                             f"{MAX_STRUCTURED_CHARS} characters")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a structured output of kind {self.kind!r} needs its {self.kind}")


@dataclass(frozen=True)
class TokenLogprobs:
    """What ``SamplingParams.logprobs`` gets for one sampled token: its log-probability
    and rank (1: the likeliest) and the ``top`` (token id, log-probability) pairs at its
    position, likeliest first (as many as asked). Made by ``engine.core.logprobs``."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    ``temperature == 0`` — or below ``GREEDY_BELOW`` — means greedy (as in vLLM).
    ``top_k == -1`` disables top-k; ``min_p`` (0: off) drops tokens less likely than
    ``min_p`` times the likeliest.

    What the logits go through first (vLLM's order, for greedy rows too): ``logit_bias``
    (token id → bias, clamped to ±100) is added; until ``min_tokens`` tokens are out, EOS
    and ``stop_token_ids`` are masked; ``repetition_penalty`` (HF's rule: a positive logit
    divided by it, a negative one multiplied) over the prompt's and the output's tokens;
    ``presence_penalty`` (once per token present) and ``frequency_penalty`` (per
    occurrence) subtracted over the output's tokens only. Then temperature, ``min_p``,
    top-k, top-p. Stop strings too wait for ``min_tokens``: they are looked for once more
    than ``min_tokens`` tokens are out (vLLM's rule).
    With ``seed`` set, sampling is a pure function of (seed, position, logits): the same
    request yields the same tokens whatever else is batched with it and in whichever
    process samples it. ``structured`` constrains every token to what keeps the output
    matching it (a JSON Schema, a regex, ...; ``engine.grammar``); the request stops once
    the output is complete. ``logprobs`` (None: off) asks for each sampled token's
    log-probability and that many likeliest alternatives (``engine.core.logprobs``);
    ``prompt_logprobs`` the same of every prompt token after the first, given the tokens
    before it (vLLM's; computed where the prompt runs, never served from the prefix
    cache, and not for a resumed request's prompt).
    Invalid values raise ``ValueError`` naming the limit.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    logprobs: int | None = None  # None: off; k in [0, 20]: the sampled token's and k more
    structured: StructuredOutput | None = None  # what the output must match (None: free)
    prompt_logprobs: int | None = None  # None: off; k in [0, 20]: each prompt token's and k more

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable/frozen.
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop", MAX_STOP_STRINGS, "stop strings"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(
            self.stop_token_ids, int, "stop_token_ids", MAX_STOP_TOKEN_IDS, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        self._validate()

    @property
    def penalized(self) -> bool:
        """Whether its logits are changed before sampling (bias, min_tokens, penalties)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: the per-token check is O(1)."""
        return frozenset(self.stop_token_ids)

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r:.40}"
                )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                                 f"{value!r}")
        _check_logprobs("logprobs", self.logprobs)
        _check_logprobs("prompt_logprobs", self.prompt_logprobs)
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be finite and > 0, got "
                             f"{self.repetition_penalty!r}")


def _check_logprobs(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is None (off) or an int in [0, MAX_LOGPROBS]."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``value`` (a mapping or pairs of token id → bias) as sorted pairs, each bias clamped
    to ±``LOGIT_BIAS_LIMIT``; ``ValueError`` for a negative id, a bias not finite, or more
    than ``MAX_LOGIT_BIAS`` entries."""
    items = list(value.items()) if isinstance(value, dict) else list(value)  # type: ignore[call-overload]
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got "
                         f"{len(items)}")
    pairs: dict[int, float] = {}
    for item in items:
        token_id, bias = item
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got "
                             f"{token_id!r:.40}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
            raise ValueError(f"logit_bias values must be finite numbers, got {bias!r:.40}")
        pairs[token_id] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(bias)))
    return tuple(sorted(pairs.items()))


def _as_tuple(value: object, kind: type, name: str, limit: int, items_name: str) -> tuple:
    """``value``'s items as a tuple, at most ``limit`` of them (counted before they are
    checked one by one), each of type ``kind``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of {kind.__name__}, got {value!r:.40}")
    items = tuple(value)  # type: ignore[call-overload]
    if len(items) > limit:
        raise ValueError(f"at most {limit} {items_name} are allowed, got {len(items)}")
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
        raise ValueError(f"{name} must contain only {kind.__name__} values")
    return items
