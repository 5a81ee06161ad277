"""The planner against a fixed split over a compressed day, on a simulated fleet
(``bench.capacity --diurnal``).

The fleet: ``--diurnal-workers`` workers of TP 1 (64 by default) on the capacity profile.
The day: ``len(DAY)`` segments of ``--segment-seconds`` each, every one a workload of
``bench.capacity.WORKLOADS`` at a level of the day's peak (RAG batches at night, chat by
day, long generation in the evening); a workload's peak rate is ``--diurnal-load`` of what
the planner's capacity model (``bench.fleet.estimate``) says the fleet serves of it at its
best split. Two arms on the same seeded arrivals:

- ``static``: the split the capacity model predicts best for the whole day (the mean of
  each segment's predicted attainment, weighted by its requests), fixed;
- ``planner``: starts at that split, with the real ``planner.policy.Planner`` switching
  roles on the simulator's clock (``sim.planning``; ``--min-prefill 1``, dwell and window
  scaled to the compressed day). A planner has one SLO: it is given the strictest of the
  workloads' (500 ms TTFT, 25 ms TPOT), while each request is scored against its own
  workload's, as the static split was chosen;
- ``scaling``: the same planner also sizing the fleet, between half the workers and all
  of them (``max_workers``): it retires workers the load does not need and adds them back
  (an added worker serves a fifth of a segment after its step).

Each arm reports its ``worker_seconds`` (workers serving × seconds: what the fleet cost).

The peak rate is a rate the model says the best split for that workload alone serves; no
fixed split serves every segment's peak, which is what a planner is for. A request meets
its SLO when its TTFT and mean TPOT are within its workload's targets;
attainment is the share of the requests sent that did, overall and by segment.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from bench.fleet import FleetWorkload, Layout, estimate, fleet_admission
from loadtest.workloads import Workload
from planner.capacity import CapacityModel
from planner.policy import PlannerConfig
from router.config import HandoffConfig
from sim.cluster import SimResult, SimSpec, simulate
from sim.metrics import arrival_times
from sim.planning import PlannerSettings
from sim.profile import Profile
from sim.state import SimRequest

# (workload, level of its peak rate): a compressed day, night to night
DAY = (("rag", 0.3), ("rag", 0.6), ("chat", 0.6), ("chat", 1.0), ("chat", 0.8),
       ("long-generation", 0.7), ("long-generation", 1.0), ("rag", 0.4))
VOCAB = 32000


def day_requests(workloads: dict[str, FleetWorkload], peaks: dict[str, float],
                 segment_s: float, seed: int) -> list[tuple[int, SimRequest]]:
    """Every request of the day, with the index of its segment (new objects each call:
    a run writes what became of them into them)."""
    out: list[tuple[int, SimRequest]] = []
    for i, (name, level) in enumerate(DAY):
        rate = peaks[name] * level
        n = max(1, round(rate * segment_s))
        times = [t for t in arrival_times(n, rate, seed + i) if t < segment_s]
        for r, t in zip(Workload(workloads[name].spec, VOCAB, seed=seed + i).take(len(times)),
                        times, strict=True):
            out.append((i, SimRequest(f"d{i}-{len(out)}", i * segment_s + t,
                                      tuple(r.prompt_token_ids), r.max_tokens)))
    return out


def best_static_split(model: CapacityModel, workloads: dict[str, FleetWorkload],
                      peaks: dict[str, float], n: int) -> int:
    """The number of prefill workers (of ``n``) the model predicts best for the day."""
    def day(p: int) -> float:
        total = weight = 0.0
        for name, level in DAY:
            w = workloads[name]
            rate = peaks[name] * level
            traffic = w.traffic(rate)
            total += rate * model.predict(traffic, p, n - p, ttft_slo_s=w.ttft_ms / 1000,
                                          tpot_slo_s=w.tpot_ms / 1000).attainment
            weight += rate
        return total / weight

    return max(range(1, n), key=day)


def attainment(result: SimResult, segments: dict[str, int], slos: list[tuple[float, float]]
               ) -> tuple[float, list[float]]:
    """Overall and per-segment share of requests within their segment's SLO."""
    met = [0] * len(slos)
    sent = [0] * len(slos)
    for r in result.requests:
        i = segments[r.request_id]
        sent[i] += 1
        if r.error or r.first_token_s is None or r.finished_s is None:
            continue
        ttft_s, tpot_s = slos[i]
        tpot = (r.finished_s - r.first_token_s) / max(1, r.max_tokens - 1)
        met[i] += r.first_token_s - r.arrival_s <= ttft_s and tpot <= tpot_s
    return sum(met) / max(1, sum(sent)), [m / s if s else math.nan
                                          for m, s in zip(met, sent, strict=True)]


def run_day(profile: Profile, workloads: dict[str, FleetWorkload], *, num_workers: int,
            load: float, segment_s: float, seed: int, scheduler: dict[str, int],
            progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Both arms over the day (see the module doc); what ``--json`` gets as ``diurnal``."""
    step = profile.step(1)
    model = CapacityModel(step, max_num_batched_tokens=scheduler["max_num_batched_tokens"],
                          block_size=profile.model.block_size,
                          handoff_s=profile.handoff_overhead_s + profile.transfer_latency_s)
    batched = scheduler["max_num_batched_tokens"]
    peaks = {name: load * max(estimate(profile, Layout(p, 1, num_workers - p, 1),
                                       workloads[name], max_num_batched_tokens=batched)
                              for p in range(1, num_workers))
             for name in sorted({name for name, _ in DAY})}
    p = best_static_split(model, workloads, peaks, num_workers)
    tagged = day_requests(workloads, peaks, segment_s, seed)
    segments = {r.request_id: i for i, r in tagged}
    slos = [(workloads[name].ttft_ms / 1000, workloads[name].tpot_ms / 1000) for name, _ in DAY]
    config = PlannerConfig(ttft_slo_s=min(s[0] for s in slos), tpot_slo_s=min(s[1] for s in slos),
                           dwell_s=segment_s / 2, min_prefill=1)
    settings = PlannerSettings(config, interval_s=max(0.5, segment_s / 10),
                               window_s=max(1.0, segment_s / 3))
    scaling = dataclasses.replace(settings, startup_s=segment_s / 5, config=dataclasses.replace(
        config, min_workers=max(2, num_workers // 2), max_workers=num_workers))
    arms: dict[str, Any] = {}
    for arm, planner in (("static", None), ("planner", settings), ("scaling", scaling)):
        requests = [r for _, r in day_requests(workloads, peaks, segment_s, seed)]  # fresh
        progress(f"diurnal: {arm} arm, {len(requests)} requests on {num_workers} workers "
                 f"({p}P+{num_workers - p}D to start) ...")
        started = time.perf_counter()
        spec = SimSpec(num_prefill=p, num_decode=num_workers - p, planner=planner,
                       handoff=HandoffConfig(local_prefill="fallback"),
                       admission=fleet_admission(num_workers),
                       max_num_seqs=scheduler["max_num_seqs"], max_num_batched_tokens=batched)
        result = simulate(profile, spec, requests)
        result.check()
        overall, by_segment = attainment(result, segments, slos)
        arms[arm] = {"slo_attainment": overall, "by_segment": by_segment,
                     "num_requests": len(result.requests),
                     "failed": sum(1 for r in result.requests if r.error),
                     "worker_seconds": result.worker_seconds,
                     "scale_steps": [{"t": c.t, "action": c.action, "role": c.role,
                                      "worker": c.worker_id, "reason": c.reason}
                                     for c in result.scale_steps],
                     "wall_s": time.perf_counter() - started,
                     "role_changes": [{"t": c.t, "worker": c.worker_id, "from": c.from_role,
                                       "to": c.to_role, "reason": c.reason}
                                      for c in result.role_changes]}
        progress(f"  {arm}: attainment {overall:.3f}, {len(result.role_changes)} role "
                 f"changes, {len(result.scale_steps)} scale steps, "
                 f"{result.worker_seconds:.0f} worker-seconds ({arms[arm]['wall_s']:.0f} s)")
    return {"workers": num_workers, "start_split": {"num_prefill": p,
                                                    "num_decode": num_workers - p},
            "segment_seconds": segment_s, "load": load, "peaks": peaks,
            "day": [{"workload": name, "level": level} for name, level in DAY],
            "planner": {"ttft_slo_s": config.ttft_slo_s, "tpot_slo_s": config.tpot_slo_s,
                        "dwell_s": config.dwell_s, "interval_s": settings.interval_s,
                        "window_s": settings.window_s, "startup_s": scaling.startup_s,
                        "min_workers": scaling.config.min_workers,
                        "max_workers": scaling.config.max_workers},
            "arms": arms}
