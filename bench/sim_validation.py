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

Lone requests before each point: ``LONE_REQUESTS`` requests of ``lone_spec`` (the
long-prompt workload's shape; prompts of their own), each sent alone through the same real
cluster and simulated alone (``lone``: their median TTFT and TPOT, real and simulated):
the profile's error with no load, apart from what load adds. A shared host's speed also
moves, between the profile and a point and from point to point, by more than the goal's
margins. ``bench.profile`` sends the same kind of lone requests through each layout
(``lone_reference``, kept in the profile's ``points``) right after measuring the steps;
against it, a point's lone requests give the host's drift since (``drift``: TTFT now ÷
then for a prefill's own costs, TPOT now ÷ then for the rest of a step), and the point is
also simulated on the profile scaled by it (``Profile.scaled``): ``errors_drift`` and
``mape_drift``, what the simulator gets wrong with the machine's speed taken as it was at
that point. ``errors`` and ``mape`` stay the profile's as measured.
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
MAX_DRIFT = 2.0  # the host's drift is taken within 1/2..2

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
    references = profile.points.get("lone_reference", {})
    if not references:
        print("the profile has no lone_reference (bench.profile before 2026-12-06): the "
              "host's drift is not measured", flush=True)
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
                    lone_requests = Workload(lone_spec(quick), vocab,
                                             seed=seed + 100 * w + 50 + r).take(LONE_REQUESTS)
                    now = lone_real(running.router_address, lone_requests, seed)
                    lone = lone_simulated(profile, sim_spec(shape), lone_requests, now)
                    drift = host_drift(now, references.get(name))
                    real = real_run(running.router_address, requests, times, rate, seed)
                    sim = sim_run(profile, sim_spec(shape), requests, times)
                    drifted = sim_run(profile.scaled(drift["prefill"], drift["decode"]),
                                      sim_spec(shape), requests, times) if drift else None
                    saturated = real["request_throughput"] < SATURATED * min(
                        rate, len(requests) / max(times[-1], 1e-9))
                    kept = (*METRIC_KEYS, "request_throughput")
                    point = {"layout": name, "workload": workload, "rate": rate,
                             "saturated": saturated, "errors": _errors(sim, real),
                             "errors_drift": _errors(drifted, real) if drifted else None,
                             "real": {k: real[k] for k in kept},
                             "simulated": {k: sim[k] for k in kept},
                             "simulated_drift": {k: drifted[k] for k in kept}
                             if drifted else None, "lone": lone, "drift": drift}
                    points.append(point)
                    print(_line(point), flush=True)
    below = [p for p in points if not p["saturated"]]
    corrected = [p for p in below if p["errors_drift"]]
    return {"points": points,
            "mape": _mape(below), "goal_met_below_saturation": _goal(below),
            "mape_drift": _mape(corrected, "errors_drift") if corrected else None,
            "goal_met_below_saturation_drift": _goal(corrected, "errors_drift")
            if corrected else None,
            "goal": "median TTFT/TPOT within 15%, p90 within 25%, at every point below "
                    "saturation", "model_dir": str(model), "profile_source": profile.source}


def lone_spec(quick: bool) -> WorkloadSpec:
    """The lone requests' shape (the long-prompt workload's; ``--quick``'s one)."""
    return QUICK_WORKLOAD if quick else WORKLOADS["long-prompt"]


def lone_real(address: str, requests: Sequence[Request], seed: int) -> dict[str, float]:
    """``requests`` each alone through the real cluster at ``address``: their median TTFT
    and TPOT (ms)."""
    alone = [real_run(address, [r], [0.0], float("inf"), seed) for r in requests]
    tpots = [m["median_tpot_ms"] for m in alone if m["median_tpot_ms"]]
    return {"ttft_ms": statistics.median(m["median_ttft_ms"] for m in alone),
            "tpot_ms": statistics.median(tpots) if tpots else 0.0}


def lone_simulated(profile: Profile, spec: SimSpec, requests: Sequence[Request],
                   real: dict[str, float]) -> dict[str, float | None]:
    """The same lone requests simulated, each alone, beside ``real`` (``lone_real``'s):
    the figures and the errors."""
    sim = sim_run(profile, spec, requests, [i * LONE_GAP_S for i in range(len(requests))])
    figures: dict[str, float | None] = {}
    for name in ("ttft", "tpot"):
        simulated, measured = sim[f"median_{name}_ms"], real[f"{name}_ms"]
        figures[f"real_{name}_ms"] = measured
        figures[f"simulated_{name}_ms"] = simulated
        figures[f"{name}_error"] = (simulated - measured) / measured if measured else None
    return figures


def lone_reference(model_dir: Path, vocab: int, *, quick: bool, pinned: bool
                   ) -> dict[str, dict[str, float]]:
    """What ``bench.profile`` keeps as ``lone_reference``: lone requests' ``lone_real``
    figures through each layout's cluster (pinned as the validation pins them, or not)."""
    found = {}
    for name in LAYOUTS:
        shape = layout(name)
        with cluster(model_dir, num_prefill=shape["num_prefill"],
                     num_decode=shape["num_decode"], local_prefill=shape["local_prefill"],
                     cpu_affinity=shape["cpu_affinity"] if pinned else None) as running:
            warm = Workload(lone_spec(quick), vocab, seed=998).take(1)
            real_run(running.router_address, warm, [0.0], float("inf"), 0)
            requests = Workload(lone_spec(quick), vocab, seed=997).take(LONE_REQUESTS)
            found[name] = lone_real(running.router_address, requests, 0)
        print(f"  alone through the {name} layout: TTFT {found[name]['ttft_ms']:.1f} ms, "
              f"TPOT {found[name]['tpot_ms']:.2f} ms", flush=True)
    return found


def host_drift(now: dict[str, float], then: dict[str, float] | None
               ) -> dict[str, float] | None:
    """How much slower this host runs lone requests ``now`` than when it was profiled
    (``then``, its ``lone_reference``): ``prefill`` from TTFT, ``decode`` from TPOT, each
    within ``1 / MAX_DRIFT .. MAX_DRIFT``; None without a reference."""
    if not then or not then.get("ttft_ms") or not then.get("tpot_ms") or not now["tpot_ms"]:
        return None

    def bounded(ratio: float) -> float:
        return min(MAX_DRIFT, max(1 / MAX_DRIFT, ratio))

    return {"prefill": bounded(now["ttft_ms"] / then["ttft_ms"]),
            "decode": bounded(now["tpot_ms"] / then["tpot_ms"]),
            "real_ttft_ms": now["ttft_ms"], "reference_ttft_ms": then["ttft_ms"],
            "real_tpot_ms": now["tpot_ms"], "reference_tpot_ms": then["tpot_ms"]}


def _errors(sim: dict[str, Any], real: dict[str, Any]) -> dict[str, float | None]:
    """Each metric's ``(simulated − real) ÷ real``."""
    return {k: (sim[k] - real[k]) / real[k] if real[k] else None for k in METRIC_KEYS}


def _mape(points: Sequence[dict[str, Any]], key: str = "errors") -> dict[str, float | None]:
    return {k: statistics.fmean(abs(p[key][k]) for p in points
                                if p[key][k] is not None) if points else None
            for k in METRIC_KEYS}


def _goal(points: Sequence[dict[str, Any]], key: str = "errors") -> bool:
    return all(abs(p[key][k] or 0) <= (0.15 if k.startswith("median") else 0.25)
               for p in points for k in METRIC_KEYS)


def _line(p: dict[str, Any]) -> str:
    def errs(errors: dict[str, float | None]) -> str:
        return " ".join(f"{k.replace('_ms', '')} {v:+.0%}" for k, v in errors.items()
                        if v is not None)

    flag = " (saturated)" if p["saturated"] else ""
    lone = " ".join(f"{k} {p['lone'][k + '_error']:+.0%}" for k in ("ttft", "tpot")
                    if p["lone"][k + "_error"] is not None)
    line = (f"  {p['layout']:<14} {p['workload']:<14} {p['rate']:>6.2f}/s{flag}: "
            f"{errs(p['errors'])} (alone: {lone})")
    if p["drift"]:
        line += (f"\n{'':<16}host x{p['drift']['prefill']:.2f} prefill, "
                 f"x{p['drift']['decode']:.2f} decode since the profile: "
                 f"{errs(p['errors_drift'])}")
    return line


def _vocab(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
