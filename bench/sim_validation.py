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
                    real = real_run(running.router_address, requests, times, rate, seed)
                    sim = sim_run(profile, sim_spec(shape), requests, times)
                    errors = {k: (sim[k] - real[k]) / real[k] if real[k] else None
                              for k in METRIC_KEYS}
                    saturated = real["request_throughput"] < SATURATED * min(
                        rate, len(requests) / max(times[-1], 1e-9))
                    point = {"layout": name, "workload": workload, "rate": rate,
                             "saturated": saturated, "errors": errors,
                             "real": {k: real[k] for k in (*METRIC_KEYS, "request_throughput")},
                             "simulated": {k: sim[k] for k in (*METRIC_KEYS,
                                                                "request_throughput")}}
                    points.append(point)
                    print(_line(point), flush=True)
    below = [p for p in points if not p["saturated"]]
    mape = {k: statistics.fmean(abs(p["errors"][k]) for p in below
                                if p["errors"][k] is not None) if below else None
            for k in METRIC_KEYS}
    goal = all(abs(p["errors"][k] or 0) <= (0.15 if k.startswith("median") else 0.25)
               for p in below for k in METRIC_KEYS)
    return {"points": points, "mape": mape, "goal_met_below_saturation": goal,
            "goal": "median TTFT/TPOT within 15%, p90 within 25%, at every point below "
                    "saturation", "model_dir": str(model), "profile_source": profile.source}


def _line(p: dict[str, Any]) -> str:
    errs = " ".join(f"{k.replace('_ms', '')} {v:+.0%}" for k, v in p["errors"].items()
                    if v is not None)
    flag = " (saturated)" if p["saturated"] else ""
    return f"  {p['layout']:<14} {p['workload']:<14} {p['rate']:>6.2f}/s{flag}: {errs}"


def _vocab(model_dir: Path) -> int:
    import json

    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
