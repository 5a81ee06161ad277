"""Synthetic workloads: what a load test or a serving benchmark sends, as token ids.

Standard library only (the locust users import it where neither torch nor the server is
installed). Prompts are random token ids, so their lengths are exact whatever the
tokenizer; every request is sent with ``ignore_eos`` so its output length is exact too.
Nothing is downloaded: the ShareGPT-like mix draws its lengths from a distribution fitted
by eye to ShareGPT's published length statistics, not from the data set.

- ``random``: input and output lengths uniform in ``len × [1 − range_ratio, 1 +
  range_ratio]`` (vLLM's ``random`` data set);
- ``prefix-repetition``: ``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each
  request one of them (in turn, then at random) plus its own ``suffix_len`` tokens
  (vLLM's ``prefix_repetition``); ``Request.prefix_id`` names the prefix, so the best a
  prefix cache can do (``oracle_cached_tokens``) can be computed;
- ``sharegpt-like``: log-normal input and output lengths (ShareGPT's conversations:
  prompts of a few to a thousand tokens, median ~100; answers median ~100, long tail),
  clipped to ``[MIN_LEN, max_input_len]`` / ``[MIN_LEN, max_output_len]``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

WORKLOADS = ("random", "prefix-repetition", "sharegpt-like")
FIRST_ID = 16  # prompt token ids start here (clear of the small ids special tokens use)
MIN_LEN = 4

# ShareGPT-like: log-normal medians and shape (sigma of the underlying normal)
SHAREGPT_INPUT_MEDIAN = 110
SHAREGPT_INPUT_SIGMA = 1.1
SHAREGPT_OUTPUT_MEDIAN = 90
SHAREGPT_OUTPUT_SIGMA = 0.9


@dataclass(frozen=True)
class Request:
    """One request to send: its prompt and how many tokens to generate (exactly:
    ``ignore_eos``). ``prefix_id``/``prefix_len``: the shared prefix it starts with."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    prefix_id: int | None = None
    prefix_len: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """Which workload and its lengths (defaults as vLLM's ``bench serve``)."""

    name: str = "random"
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    max_input_len: int = 1024  # sharegpt-like clips here
    max_output_len: int = 512

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.name!r}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        for field in ("input_len", "output_len", "prefix_len", "suffix_len", "num_prefixes",
                      "max_input_len", "max_output_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")


def _ids(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    # choices draws five times as fast as a randrange per id (a simulated fleet's
    # workload is millions of ids)
    return tuple(rng.choices(range(FIRST_ID, vocab_size), k=n))


def _around(rng: random.Random, length: int, ratio: float) -> int:
    low, high = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    return max(1, rng.randint(low, high))


def _lognormal(rng: random.Random, median: float, sigma: float, high: int) -> int:
    return min(high, max(MIN_LEN, round(rng.lognormvariate(math.log(median), sigma))))


class Workload:
    """Draws ``Request``s of one ``WorkloadSpec`` from one seeded generator; the prefixes
    of ``prefix-repetition`` are drawn once, at construction."""

    def __init__(self, spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> None:
        if vocab_size <= FIRST_ID:
            raise ValueError(f"vocab_size must exceed {FIRST_ID}, got {vocab_size}")
        self.spec = spec
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self._prefixes = [_ids(self.rng, spec.prefix_len, vocab_size)
                          for _ in range(spec.num_prefixes if spec.name == "prefix-repetition"
                                         else 0)]
        self._drawn = 0

    def next(self) -> Request:
        s, rng = self.spec, self.rng
        self._drawn += 1
        if s.name == "random":
            return Request(_ids(rng, _around(rng, s.input_len, s.range_ratio), self.vocab_size),
                           _around(rng, s.output_len, s.range_ratio))
        if s.name == "prefix-repetition":
            # every prefix once first (in order), then at random
            pid = self._drawn - 1 if self._drawn <= s.num_prefixes else rng.randrange(
                s.num_prefixes)
            prompt = self._prefixes[pid] + _ids(rng, s.suffix_len, self.vocab_size)
            return Request(prompt, s.output_len, pid, s.prefix_len)
        n_in = _lognormal(rng, SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA, s.max_input_len)
        n_out = _lognormal(rng, SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA, s.max_output_len)
        return Request(_ids(rng, n_in, self.vocab_size), n_out)

    def take(self, n: int) -> list[Request]:
        return [self.next() for _ in range(n)]


def oracle_cached_tokens(requests: Sequence[Request], block_size: int) -> list[int]:
    """Per request, the prompt tokens a perfect prefix cache serves: its shared prefix's
    full blocks once that prefix was used before, else 0 (the prompt's last token is
    always computed)."""
    seen: set[int] = set()
    cached = []
    for r in requests:
        if r.prefix_id is None or r.prefix_id not in seen:
            cached.append(0)
        else:
            full = (min(r.prefix_len, r.prompt_len - 1) // block_size) * block_size
            cached.append(full)
        if r.prefix_id is not None:
            seen.add(r.prefix_id)
    return cached
