"""The search ``bench.capacity`` runs: the layouts of N GPUs, a quick analytic estimate of
each one's goodput (the planner's capacity model), and the simulated goodput of the best.

- ``layouts(n, tps)``: every disaggregated layout (``p`` prefill workers of TP ``a`` and
  ``d`` decode workers of TP ``b``, ``p·a + d·b = n``) and every colocated one (``n / b``
  workers of TP ``b`` prefilling locally);
- ``estimate(...)``: the highest rate at which ``planner.capacity.CapacityModel`` predicts
  ``ATTAINMENT`` of the SLO (the prefill side from TP ``a``'s step model, the decode side
  from TP ``b``'s), used to rank the layouts and to start the search;
- ``goodput(...)``: the highest Poisson rate at which the simulator (``sim``: the router's
  and the scheduler's real code) serves ``ATTAINMENT`` of the requests within the SLO,
  found by bracketing then bisecting the rate in at most ``probes`` simulated runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.workloads import Workload, WorkloadSpec
from planner.capacity import CapacityModel, Traffic
from router.config import AdmissionConfig, HandoffConfig
from sim.cluster import SimSpec
from sim.metrics import arrival_times
from sim.profile import Profile
from sim.runs import run

ATTAINMENT = 0.9  # goodput: the highest rate at which this share of requests meets the SLO
VOCAB = 32000
MAX_INFLIGHT_PER_GPU = 512


@dataclass(frozen=True)
class Layout:
    """``num_prefill`` workers of TP ``prefill_tp`` and ``num_decode`` of TP ``decode_tp``
    (``num_prefill`` 0: colocated, the decode workers prefill locally; ``prefill_tp`` is
    then ``decode_tp``)."""

    num_prefill: int
    prefill_tp: int
    num_decode: int
    decode_tp: int

    @property
    def gpus(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    def __str__(self) -> str:
        decode = f"{self.num_decode}xTP{self.decode_tp}"
        return f"{decode} colocated" if self.colocated else \
            f"{self.num_prefill}xTP{self.prefill_tp} P + {decode} D"

    def spec(self, *, max_num_seqs: int, max_num_batched_tokens: int) -> SimSpec:
        return SimSpec(num_prefill=self.num_prefill, num_decode=self.num_decode,
                       prefill_tp=self.prefill_tp if self.num_prefill else self.decode_tp,
                       decode_tp=self.decode_tp,
                       handoff=HandoffConfig(local_prefill="always" if self.colocated
                                             else "never"),
                       admission=fleet_admission(self.gpus),
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)

    def scaled(self, factor: int) -> Layout:
        return Layout(self.num_prefill * factor, self.prefill_tp, self.num_decode * factor,
                      self.decode_tp)


def fleet_admission(gpus: int) -> AdmissionConfig:
    """The router's admission for a fleet: room for every request the GPUs can hold
    (``MAX_INFLIGHT_PER_GPU`` each) and no cap on queued prompt tokens, so that an
    overloaded fleet answers late (missing its SLO) rather than the router refusing: one
    router's defaults (1,024 in flight) would cap a large fleet below its capacity."""
    return AdmissionConfig(max_inflight=max(AdmissionConfig.max_inflight,
                                            MAX_INFLIGHT_PER_GPU * gpus),
                           max_queued_tokens=None)


def layouts(n: int, tps: Sequence[int]) -> list[Layout]:
    """Every layout of exactly ``n`` GPUs with TP sizes from ``tps``."""
    found = [Layout(0, b, n // b, b) for b in tps if n % b == 0]
    for a in tps:
        for b in tps:
            for p in range(1, n // a + 1):
                rest = n - p * a
                if rest >= b and rest % b == 0:
                    found.append(Layout(p, a, rest // b, b))
    return found


@dataclass(frozen=True)
class FleetWorkload:
    """A workload of ``bench.capacity``: what is asked and the SLO it must meet."""

    name: str
    spec: WorkloadSpec
    ttft_ms: float
    tpot_ms: float

    def traffic(self, rate: float) -> Traffic:
        """Its mean prompt and output lengths (of 400 requests), at ``rate``."""
        return Traffic(rate, *_mean_lengths(self.spec))


@functools.cache
def _mean_lengths(spec: WorkloadSpec) -> tuple[float, float]:
    sample = Workload(spec, VOCAB, seed=0).take(400)
    return (sum(len(r.prompt_token_ids) for r in sample) / len(sample),
            sum(r.max_tokens for r in sample) / len(sample))


def estimate(profile: Profile, layout: Layout, workload: FleetWorkload, *,
             max_num_batched_tokens: int) -> float:
    """The capacity model's goodput estimate of ``layout`` (requests per second)."""
    def model(tp: int) -> CapacityModel:
        return CapacityModel(profile.step(tp), max_num_batched_tokens=max_num_batched_tokens,
                             block_size=profile.model.block_size,
                             handoff_s=profile.handoff_overhead_s + profile.transfer_latency_s)

    prefill, decode = model(layout.prefill_tp), model(layout.decode_tp)
    slo = {"ttft_slo_s": workload.ttft_ms / 1000, "tpot_slo_s": workload.tpot_ms / 1000}

    def attainment(rate: float) -> float:
        traffic = workload.traffic(rate)
        p, d = layout.num_prefill, layout.num_decode
        if layout.colocated:
            return decode.predict(traffic, 0, d, **slo).attainment
        return prefill.predict(traffic, p, d, **slo).ttft * decode.predict(traffic, p, d,
                                                                           **slo).tpot

    low, high = 0.0, 1.0
    while attainment(high) >= ATTAINMENT and high < 1e6:
        low, high = high, high * 2
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if attainment(mid) >= ATTAINMENT else (low, mid)
    return low


def goodput(profile: Profile, layout: Layout, workload: FleetWorkload, start: float, *,
            duration_s: float, max_prompts: int, probes: int, seed: int,
            scheduler: dict[str, int], progress: Callable[[str], None]) -> dict[str, Any]:
    """The simulated goodput of ``layout`` (see the module doc), the search starting at
    ``start`` req/s: ``{"goodput": rate, "bracketed": bool, "probes": [{rate, attainment,
    ...}]}``. ``bracketed`` False: the probes ran out before a rate missed (goodput is at
    least that) or before one met it (goodput 0: below the lowest rate tried)."""
    tried: list[dict[str, Any]] = []

    def attainment(rate: float) -> float:
        n = max(50, min(max_prompts, round(rate * duration_s)))
        requests = Workload(workload.spec, VOCAB, seed=seed).take(n)
        result = run(profile, layout.spec(**scheduler), requests,
                     arrival_times(n, rate, seed),
                     {"ttft": workload.ttft_ms, "tpot": workload.tpot_ms})
        tried.append({"rate": rate, "num_prompts": n, "attainment": result["slo_attainment"],
                      "median_ttft_ms": result["median_ttft_ms"],
                      "median_tpot_ms": result["median_tpot_ms"],
                      "wall_s": result["simulation"]["wall_s"]})
        progress(f"  {workload.name} {layout}: {rate:.1f} req/s x {n} -> attainment "
                 f"{result['slo_attainment']:.2f} ({result['simulation']['wall_s']:.1f} s)")
        return float(result["slo_attainment"])

    low, high, rate = 0.0, float("inf"), max(start, 0.1)
    while len(tried) < probes and (high == float("inf") or low == 0.0):
        if attainment(rate) >= ATTAINMENT:
            low, rate = rate, rate * 1.5
        else:
            high, rate = rate, rate / 1.5
    while len(tried) < probes and low > 0 and high < float("inf"):
        mid = (low + high) / 2
        low, high = (mid, high) if attainment(mid) >= ATTAINMENT else (low, mid)
    return {"goodput": low, "bracketed": 0 < low and high < float("inf"), "probes": tried}
