"""Per-request sampling parameters, named as vLLM names them. Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
GREEDY_BELOW = 1e-5
"""A temperature below this is greedy (as vLLM's sampler treats it): dividing logits by a
tiny positive temperature overflows to inf and NaN."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    ``temperature == 0`` — or below ``GREEDY_BELOW`` — means greedy (as in vLLM).
    ``top_k == -1`` disables top-k.
    With ``seed`` set, sampling is a pure function of (seed, position, logits): the same
    request yields the same tokens whatever else is batched with it and in whichever
    process samples it. Invalid values raise ``ValueError`` naming the limit.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable/frozen.
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop", MAX_STOP_STRINGS, "stop strings"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(
            self.stop_token_ids, int, "stop_token_ids", MAX_STOP_TOKEN_IDS, "stop_token_ids"))
        self._validate()

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
