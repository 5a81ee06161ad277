"""``python -m bench.simulate --validate``: the simulator against real clusters.

For each layout (``disaggregated``: one prefill and one decode worker; ``colocated``: two
decode workers with ``--local-prefill always``; each worker pinned to its own core with one
torch thread, as ``bench.disagg`` starts them), each workload (``long-prompt``: 512 → 32
tokens, ``sharegpt-like``) and each rate of ``--validate-rates``: the same seeded requests
at the same Poisson send times (new prompts at each point: the real cluster's prefix cache
would serve the earlier points' again) go through the real cluster (``bench.serving.run``, the
gRPC backend) and through the simulator on ``--profile`` (the same layout and router
flags). Each metric's error is ``(simulated − real) ÷ real``; a point is *saturated* when
the real cluster's request throughput fell below 90% of the rate sent (reported, kept out
of the MAPE). ``--quick``: the tiny model, the disaggregated layout, one small workload at
one rate (the test suite's point).

Lone requests before each point: ``LONE_REQUESTS`` requests of the point's workload
(prompts of their own), each sent alone through the same real cluster and simulated
alone (``lone``: their median TTFT and TPOT, real and simulated, and the errors). They
tell the profile's error at no load, or the machine's drift since it was profiled, from
the error that load adds (queues, batching, routing), which the point's own errors mix.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.clusters import bench_model, cluster, two_cpus
from bench.serving import GrpcBackend
from loadtest.workloads import Request, Workload, WorkloadSpec
from router.config import HandoffConfig
from sim.cluster import SimSpec
from sim.metrics import arrival_times, metrics
from sim.profile import Profile
from sim.runs import run as sim_run

METRIC_KEYS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms", "p90_tpot_ms")
WORKLOADS = {"long-prompt": WorkloadSpec("random", input_len=512, output_len=32),
             "sharegpt-like": WorkloadSpec("sharegpt-like", output_len=64)}
QUICK_WORKLOAD = WorkloadSpec("random", input_len=128, output_len=16)
LAYOUTS = ("disaggregated", "colocated")
SATURATED = 0.9  # real throughput below this share of the rate sent: past saturation
LONE_REQUESTS = 3  # sent alone before each point
LONE_GAP_S = 1000.0  # virtual seconds between the simulated lone requests: each alone

def layout(name: str) -> dict[str, Any]:
    first, last = two_cpus()
    if name == "disaggregated":
        return {"num_prefill": 1, "num_decode": 1, "local_prefill": "never",
                "cpu_affinity": {"prefill-0": (first,), "decode-0": (last,)}}
    return {"num_prefill": 0, "num_decode": 2, "local_prefill": "always",
            "cpu_affinity": {"decode-0": (first,), "decode-1": (last,)}}


def sim_spec(shape: dict[str, Any]) -> SimSpec:
    return SimSpec(num_prefill=shape["num_prefill"], num_decode=shape["num_decode"],
                   handoff=HandoffConfig(local_prefill=shape["local_prefill"]))


def real_run(address: str, requests: Sequence[Request], times: Sequence[float],
             rate: float, seed: int) -> dict[str, Any]:
    async def go() -> tuple[list[Any], float]:
        backend = GrpcBackend(address)
        try:
            from bench.serving import run

            return await run(backend, requests, request_rate=rate, seed=seed)
        finally:
            await backend.close()

    outcomes, duration = asyncio.run(go())
    return metrics(outcomes, duration)


def validate(profile: Profile, model_dir: Path | None, *, quick: bool, rates: Sequence[float],
             num_prompts: int, seed: int) -> dict[str, Any]:
    model = model_dir or bench_model(quick)
    vocab = _vocab(model)
    layouts = ("disaggregated",) if quick else LAYOUTS
    workloads = {"quick": QUICK_WORKLOAD} if quick else WORKLOADS
    points: list[dict[str, Any]] = []
    for name in layouts:
        shape = layout(name)
        with cluster(model, num_prefill=shape["num_prefill"], num_decode=shape["num_decode"],
                     local_prefill=shape["local_prefill"],
                     cpu_affinity=shape["cpu_affinity"]) as running:
            for w, (workload, spec) in enumerate(workloads.items()):
                warm = Workload(spec, vocab, seed=seed + 999).take(2)
                real_run(running.router_address, warm, [0.0, 0.0], float("inf"), seed)
                for r, rate in enumerate(rates):
                    # fresh prompts at every point: the real cluster's prefix cache keeps
                    # the earlier points' prompts, the simulator starts empty
                    requests = Workload(spec, vocab, seed=seed + 100 * w + r).take(num_prompts)
                    times = arrival_times(len(requests), rate, seed)
                    lone_requests = Workload(spec, vocab, seed=seed + 100 * w + 50 + r).take(
                        1 if quick else LONE_REQUESTS)
                    lone = lone_figures(running.router_address, profile, sim_spec(shape),
                                        lone_requests, seed)
                    real = real_run(running.router_address, requests, times, rate, seed)
                    sim = sim_run(profile, sim_spec(shape), requests, times)
                    saturated = real["request_throughput"] < SATURATED * min(
                        rate, len(requests) / max(times[-1], 1e-9))
                    kept = (*METRIC_KEYS, "request_throughput")
                    point = {"layout": name, "workload": workload, "rate": rate,
                             "saturated": saturated, "errors": _errors(sim, real),
                             "real": {k: real[k] for k in kept},
                             "simulated": {k: sim[k] for k in kept}, "lone": lone}
                    points.append(point)
                    print(_line(point), flush=True)
    below = [p for p in points if not p["saturated"]]
    return {"points": points,
            "mape": _mape(below), "goal_met_below_saturation": _goal(below),
            "goal": "median TTFT/TPOT within 15%, p90 within 25%, at every point below "
                    "saturation", "model_dir": str(model), "profile_source": profile.source}


def lone_figures(address: str, profile: Profile, spec: SimSpec,
                 requests: Sequence[Request], seed: int) -> dict[str, float | None]:
    """``requests`` each alone through the real cluster at ``address`` and through the
    simulator: their median TTFT and TPOT (ms), real and simulated, and the errors."""
    alone = [real_run(address, [r], [0.0], float("inf"), seed) for r in requests]
    tpots = [m["median_tpot_ms"] for m in alone if m["median_tpot_ms"]]
    real = {"median_ttft_ms": statistics.median(m["median_ttft_ms"] for m in alone),
            "median_tpot_ms": statistics.median(tpots) if tpots else 0.0}
    sim = sim_run(profile, spec, requests, [i * LONE_GAP_S for i in range(len(requests))])
    figures: dict[str, float | None] = {}
    for key in real:
        name = key.replace("median_", "").replace("_ms", "")
        figures[f"real_{name}_ms"] = real[key]
        figures[f"simulated_{name}_ms"] = sim[key]
        figures[f"{name}_error"] = (sim[key] - real[key]) / real[key] if real[key] else None
    return figures


def _errors(sim: dict[str, Any], real: dict[str, Any]) -> dict[str, float | None]:
    """Each metric's ``(simulated − real) ÷ real``."""
    return {k: (sim[k] - real[k]) / real[k] if real[k] else None for k in METRIC_KEYS}


def _mape(points: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    return {k: statistics.fmean(abs(p["errors"][k]) for p in points
                                if p["errors"][k] is not None) if points else None
            for k in METRIC_KEYS}


def _goal(points: Sequence[dict[str, Any]]) -> bool:
    return all(abs(p["errors"][k] or 0) <= (0.15 if k.startswith("median") else 0.25)
               for p in points for k in METRIC_KEYS)


def _line(p: dict[str, Any]) -> str:
    errs = " ".join(f"{k.replace('_ms', '')} {v:+.0%}" for k, v in p["errors"].items()
                    if v is not None)
    flag = " (saturated)" if p["saturated"] else ""
    lone = " ".join(f"{k} {p['lone'][k + '_error']:+.0%}" for k in ("ttft", "tpot")
                    if p["lone"][k + "_error"] is not None)
    return (f"  {p['layout']:<14} {p['workload']:<14} {p['rate']:>6.2f}/s{flag}: {errs} "
            f"(alone: {lone})")


def _vocab(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
