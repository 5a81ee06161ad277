"""What a prefill/decode split would give: predicted SLO attainment from each role's
capacity, built from a worker's measured step costs (``bench.profile``'s fit).

The model, per window of traffic (arrival rate λ, mean prompt P and output O tokens):

- **prefill**: one prompt costs ``S`` seconds alone (its chunks of at most
  ``max_num_batched_tokens``, each a step), and a saturated worker, whose steps are full,
  finishes ``μ`` prompts per second (the fixed cost of a step shared by the prompts in
  it). The ``p`` prefill workers are one queue of rate ``p·μ``: at load ``ρ = λ / (p·μ)``
  the time to first token is about exponential with mean ``S / (1 - ρ)`` (an M/M/1
  sojourn), so ``P(TTFT ≤ slo) = 1 - exp(-(slo - h)(1 - ρ) / S)``, ``h`` the handoff's
  fixed cost; 0 at ``ρ ≥ 1``.
- **decode**: by Little's law each of the ``d`` decode workers runs ``b = λ·O·t / d``
  sequences, ``t`` the step time at that batch, ``t = base + b·(per_seq + per_context·C)``
  with ``C = P + O/2`` the mean context: ``b = λ·O·base / (d - λ·O·(per_seq +
  per_context·C))``, no fixed point (overload) when that is not positive; ``base`` is
  the step's fixed cost, with ``multi_token`` in it in full from ``b = 2`` and in part
  between 1 and 2 (a prefill step's has both fixed costs of a step's kind,
  ``multi_token`` and ``prefill_step``). The requests'
  TPOTs spread about ``t`` (normal, ``TPOT_SPREAD`` of it): attainment is the share of
  them within ``tpot_slo``; 0 when the batch's KV does not fit in the workers' pools.
- without prefill workers (``p = 0``) the decode workers prefill too: the prefill queue
  runs at their rate, and the share of their time it takes (``λ·S / d``) stretches their
  decode steps.

The product of the two is the split's predicted attainment. The observed figures
correct the model: a measured prefill queue wait implies an effective prefill rate
(``effective_prefill_rate``), a measured inter-token latency an effective decode cost;
the planner uses the smaller capacity of the model's and the measurement's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class StepCosts(Protocol):
    """A worker's step time terms, seconds (``sim.profile.StepModel`` has them), and its
    KV pool in blocks."""

    @property
    def base_s(self) -> float: ...
    @property
    def multi_token_s(self) -> float: ...
    @property
    def prefill_step_s(self) -> float: ...
    @property
    def per_prefill_token_s(self) -> float: ...
    @property
    def per_prefill_attention_s(self) -> float: ...
    @property
    def per_decode_seq_s(self) -> float: ...
    @property
    def per_decode_context_s(self) -> float: ...
    @property
    def num_kv_blocks(self) -> int: ...


TPOT_SPREAD = 0.25
"""Requests' TPOTs spread about the mean step time (coefficient of variation, normal)."""


@dataclass(frozen=True)
class Traffic:
    """One window's traffic: arrivals per second, mean prompt and output tokens."""

    rate: float
    prompt_tokens: float
    output_tokens: float


@dataclass(frozen=True)
class Prediction:
    """A split's predicted attainment (``ttft`` × ``tpot``) and its parts."""

    num_prefill: int
    num_decode: int
    ttft: float  # predicted P(TTFT <= slo)
    tpot: float  # predicted fraction of requests within the TPOT SLO
    prefill_load: float  # rho of the prefill queue
    decode_step_s: float  # predicted decode step (inf: overloaded)

    @property
    def attainment(self) -> float:
        return self.ttft * self.tpot


@dataclass(frozen=True)
class CapacityModel:
    """Each role's capacity on one worker of ``costs`` (``max_num_batched_tokens``: the
    workers' step budget; ``block_size``: tokens per KV block; ``handoff_s``: the fixed
    cost between prefill and decode)."""

    costs: StepCosts
    max_num_batched_tokens: int = 512
    block_size: int = 16
    handoff_s: float = 0.0

    def prefill_s(self, prompt_tokens: float) -> float:
        """Seconds one prompt's prefill takes alone (its chunks, one step each)."""
        c, left, start, total = self.costs, max(1.0, prompt_tokens), 0.0, 0.0
        while left > 0:
            n = min(left, float(self.max_num_batched_tokens))
            total += (self._prefill_fixed_s + c.per_prefill_token_s * n
                      + c.per_prefill_attention_s * n * (start + n / 2))
            start, left = start + n, left - n
        return total

    @property
    def _prefill_fixed_s(self) -> float:
        """A prefill step's fixed cost."""
        c = self.costs
        return c.base_s + c.multi_token_s + c.prefill_step_s

    def prefill_rate(self, prompt_tokens: float) -> float:
        """Prompts per second a saturated prefill worker finishes (full steps: the fixed
        cost of a step shared by the prompts in it)."""
        c, p = self.costs, max(1.0, prompt_tokens)
        steps = p / self.max_num_batched_tokens
        attention = c.per_prefill_attention_s * p * p / 2
        return 1.0 / (self._prefill_fixed_s * steps + c.per_prefill_token_s * p + attention)

    def decode_step(self, traffic: Traffic, num_decode: int, scale: float = 1.0) -> float:
        """The decode workers' predicted step seconds (``inf``: they cannot keep up);
        ``scale`` multiplies the costs (the observed correction)."""
        c, demand = self.costs, traffic.rate * traffic.output_tokens
        per_seq = scale * (c.per_decode_seq_s + c.per_decode_context_s
                           * (traffic.prompt_tokens + traffic.output_tokens / 2))
        room = num_decode - demand * per_seq
        if num_decode <= 0 or room <= 0:
            return math.inf
        # steps of more than one token pay multi_token too: in full from a batch of two,
        # in part between one and two (continuous in the traffic)
        alone = demand * scale * c.base_s / room
        fixed = c.base_s + c.multi_token_s * min(1.0, max(0.0, alone - 1))
        batch = demand * scale * fixed / room
        return scale * fixed + batch * per_seq

    def inter_token_s(self, traffic: Traffic, num_prefill: int, num_decode: int,
                      scale: float = 1.0) -> float:
        """The split's predicted mean inter-token latency: its decode step (``scale`` as
        ``decode_step`` takes it), stretched by the share of time its decode workers spend
        prefilling when they prefill (``p = 0``). What ``predict`` judges the TPOT by, and
        what an observed mean ITL of that split is compared with."""
        step = self.decode_step(traffic, num_decode, scale)
        if num_prefill == 0 and num_decode > 0:
            busy = traffic.rate * self.prefill_s(traffic.prompt_tokens) / num_decode
            step = step / (1 - busy) if busy < 1 else math.inf
        return step

    def kv_fits(self, traffic: Traffic, num_decode: int, step_s: float) -> bool:
        """The decode batch's KV fits in the decode workers' pools (90% of them)."""
        if math.isinf(step_s) or num_decode <= 0:
            return False
        seqs = traffic.rate * traffic.output_tokens * step_s
        blocks = seqs * math.ceil((traffic.prompt_tokens + traffic.output_tokens)
                                  / self.block_size)
        return blocks <= 0.9 * num_decode * self.costs.num_kv_blocks

    def predict(self, traffic: Traffic, num_prefill: int, num_decode: int, *,
                ttft_slo_s: float, tpot_slo_s: float, prefill_rate: float | None = None,
                decode_scale: float = 1.0) -> Prediction:
        """The split's predicted attainment; ``prefill_rate`` (per worker) and
        ``decode_scale`` override the model with what was measured."""
        rate = self.prefill_rate(traffic.prompt_tokens) if prefill_rate is None else prefill_rate
        servers = num_prefill if num_prefill > 0 else num_decode  # local prefill without any
        load = traffic.rate / (servers * rate) if servers > 0 and rate > 0 else math.inf
        service = self.prefill_s(traffic.prompt_tokens)
        budget = ttft_slo_s - (self.handoff_s if num_prefill > 0 else 0.0)
        ttft = 0.0 if load >= 1 or budget <= 0 else 1 - math.exp(-budget * (1 - load) / service)
        step = self.inter_token_s(traffic, num_prefill, num_decode, decode_scale)
        tpot = 0.0 if not self.kv_fits(traffic, num_decode, step) else _normal_cdf(
            (tpot_slo_s - step) / (TPOT_SPREAD * step))
        return Prediction(num_prefill, num_decode, ttft, tpot, load, step)


def _normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def effective_prefill_rate(traffic: Traffic, num_prefill: int, queue_wait_s: float) -> float:
    """The per-worker prefill rate an observed mean queue wait implies (M/M/1 of rate
    ``p·μ``: ``W = λ / (pμ (pμ - λ))``); ``inf`` when nothing waited or nothing arrived."""
    lam = traffic.rate
    if queue_wait_s <= 0 or lam <= 0 or num_prefill <= 0:
        return math.inf
    pooled = (lam + math.sqrt(lam * lam + 4 * lam / queue_wait_s)) / 2
    return pooled / num_prefill
