"""One simulation of a ``bench.serve`` workload, measured as ``bench.serve`` measures a real
run (``sim.metrics``): ``run`` (``pdserve simulate``, ``sim.cli``, and
``bench.sim_validation`` call it)."""

from __future__ import annotations

import gc
import itertools
import operator
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from loadtest.workloads import Request
from sim.cluster import Progress, SimResult, SimSpec, simulate
from sim.metrics import DEFAULT_PERCENTILES, Outcome, details, metrics
from sim.profile import Profile
from sim.state import SimRequest


def sim_requests(requests: Sequence[Request], times: Sequence[float]) -> list[SimRequest]:
    """The workload's requests, arriving at ``times``."""
    return [SimRequest(f"sim-{i}", t, r.prompt_token_ids, r.max_tokens)
            for i, (r, t) in enumerate(zip(requests, times, strict=True))]


def outcomes(result: SimResult) -> list[Outcome]:
    """Each simulated request as ``bench.serving`` measures a real one (times from its
    arrival, one per streamed token)."""
    out = []
    for r in result.requests:
        o = Outcome(r.prompt_len, r.max_tokens, sent_at=r.arrival_s)
        if r.error or r.first_token_s is None or r.finished_s is None:
            o.error = r.error or "unfinished"
        else:
            o.success = True
            o.output_len = len(r.token_times_s)
            o.cached_tokens = r.cached_tokens
            o.ttft = r.first_token_s - r.arrival_s
            o.latency = r.finished_s - r.arrival_s
            times = r.token_times_s
            o.token_times = list(map(operator.sub, times, itertools.repeat(r.arrival_s)))
            o.itl = list(map(operator.sub, times[1:], times))  # each gap: b - a
        out.append(o)
    return out


def run(profile: Profile, spec: SimSpec, requests: Sequence[Request], times: Sequence[float],
        slo_ms: dict[str, float] | None = None,
        percentiles: Sequence[float] = DEFAULT_PERCENTILES, *,
        detailed: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """One simulation of ``requests`` arriving at ``times``: ``bench.serve``'s metrics
    (``sim.metrics``), ``simulation`` (wall and virtual seconds, events, each worker's busy
    share and steps) and, ``detailed``, the per-request lists (``sim.metrics.details``);
    ``progress``: as ``sim.cluster.simulate``'s."""
    started = time.perf_counter()
    with _fewer_collections():  # measuring makes millions of objects too
        result = simulate(profile, spec, sim_requests(requests, times), progress=progress)
        wall = time.perf_counter() - started
        result.check()
        done = outcomes(result)
        figures = metrics(done, result.duration_s, slo_ms=slo_ms or None,
                          percentiles=percentiles)
    return {**figures,
            "simulation": {"wall_s": wall, "events": result.num_events,
                           "virtual_s": result.duration_s,
                           "workers": {w.worker_id: {"busy": w.busy_s / result.duration_s
                                                     if result.duration_s else 0.0,
                                                     "steps": w.num_steps}
                                       for w in result.workers}},
            **(details(done) if detailed else {})}


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """A simulation makes millions of short-lived objects and keeps much of what it makes
    (the requests' records): meanwhile the garbage collector's first generation runs a
    hundredth as often (5% of a 20,000-request run's time here). Cycles are rare in it;
    any are collected once the thresholds are back. (Process-wide: runs are not made
    from several threads at once.)"""
    thresholds = gc.get_threshold()
    try:
        gc.set_threshold(min(100 * thresholds[0], 1_000_000), *thresholds[1:])
        yield
    finally:
        gc.set_threshold(*thresholds)
