"""What disaggregation buys: goodput of one prefill + one decode worker against two
colocated replicas, on the same two cores, with the whole curve.

    python -m bench.disagg [--json out.json] [--plot plots/] [--quick]

The two arms differ only in the split (the report prints both configurations side by
side): the same model (``bench55m``, fp32), the same router, workload and arrivals (the
same seeded prompts at the same Poisson send times), one torch thread per worker process,
the same KV block budget per worker (so per core), each worker pinned to its own core:

- disaggregated: ``prefill-0`` on the first core, ``decode-0`` on the last, the router
  without conditional disaggregation (``--local-prefill-max-tokens 0``: every prompt
  through the prefill worker);
- colocated: ``decode-0`` on the first core and ``decode-1`` on the last, the router in
  ``--local-prefill always`` (each request prefilled on the decode worker that streams it).

The router, Redis and this load client are not pinned: they share both cores alike in the
two arms (they use little: one gRPC stream per request).

For each workload (``long-prompt``: 512 prompt tokens → 64 output tokens; ``sharegpt-like``:
synthetic ShareGPT-like lengths, outputs clipped at 128), each arm first serves a few
requests one at a time (unloaded latencies), then a sweep of request rates: at each,
``rate × --seconds-per-rate`` requests (at least ``--min-requests``) arrive as a Poisson
process. Default rates are fractions (``--rate-fractions``, ``--sharegpt-rate-fractions``)
of one core's prefill capacity, ``1 / unloaded TTFT`` of the disaggregated arm; ``--rates``
gives them instead.

The SLO is chosen from the unloaded latencies, the slower arm's: TTFT ≤
``--ttft-slo-factor`` × unloaded TTFT and TPOT ≤ ``--tpot-slo-factor`` × unloaded TPOT
(medians; a TPOT-bound SLO by default: 5× and 1.5×), or ``--ttft-slo-ms`` /
``--tpot-slo-ms`` as given: the unloaded latencies are a few requests on a shared machine,
so give the pair itself to compare runs. A request meets it when it completes
within both; attainment is the share of the requests sent that did (a request unfinished
``--cut-off-factor`` times the longest it could take and meet the SLO is cancelled and
counted as missing it, which bounds the time an overloaded rate takes; the JSON says
whether every cut-off was one that could no longer meet the SLO). ``max_rate_at_slo``
is the highest rate swept with ≥ 90% attainment; ``goodput_ratio`` = disaggregated ÷
colocated ``max_rate_at_slo`` (the headline; ``null`` when the colocated arm met the SLO at
no rate); ``goodput_ratio_range`` is [low, high] of the true ratio on the grid swept (each
arm's limit lies between its ``max_rate_at_slo`` and the next rate; ``null``: unbounded). Per rate it also prints which target the misses missed (TTFT or TPOT): where
each arm wins, and why.

``--json PATH`` writes every figure (vLLM's metric keys per rate), the machine facts and
both configurations; ``--plot DIR`` writes attainment against rate, and TTFT/TPOT CDFs of
both arms at one rate, per workload. Defaults take about 10 minutes on 2 cores;
``--quick`` (the tiny model, two rates, a few requests) takes seconds and is what the tests
run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.clusters import bench_model, cluster, describe, one_by_one, send, two_cpus
from bench.common import BandwidthProbe, format_table, machine_info, model_facts, write_json
from loadtest.workloads import Request, Workload, WorkloadSpec
from sim.metrics import CUT_OFF, Outcome, metrics

ARMS = ("disaggregated", "colocated")
ATTAINMENT_TARGET = 0.9


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint (default: bench55m; --quick: the tiny model)")
    p.add_argument("--workloads", default="long-prompt,sharegpt-like")
    p.add_argument("--input-len", type=int, default=512, help="long-prompt: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="long-prompt: output tokens")
    p.add_argument("--max-output-len", type=int, default=128, help="sharegpt-like: clip")
    p.add_argument("--rates", help="request rates to sweep, comma-separated (req/s)")
    p.add_argument("--rate-fractions", default="0.1,0.25,0.5,0.75,1.0,1.25",
                   help="long-prompt's default rates: these fractions of 1 / unloaded TTFT")
    p.add_argument("--sharegpt-rate-fractions", default="0.05,0.15,0.3,0.45,0.6",
                   help="sharegpt-like's (lower: its long outputs load the decode side "
                        "more than its short prompts load the prefill side)")
    p.add_argument("--seconds-per-rate", type=float, default=10.0)
    p.add_argument("--min-requests", type=int, default=10)
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--unloaded-requests", type=int, default=5)
    p.add_argument("--cut-off-factor", type=float, default=2.0,
                   help="a request is cut off (and misses the SLO) when still unfinished this "
                        "many times the longest it could take and meet the SLO")
    p.add_argument("--ttft-slo-factor", type=float, default=5.0)
    p.add_argument("--tpot-slo-factor", type=float, default=1.5)
    p.add_argument("--ttft-slo-ms", type=float,
                   help="the TTFT target itself, instead of the factor (to compare runs)")
    p.add_argument("--tpot-slo-ms", type=float, help="the TPOT target itself")
    p.add_argument("--num-kv-blocks", type=int, default=2048, help="per worker (per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--quick", action="store_true",
                   help="tiny model, short requests, two rates: seconds (for tests)")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(input_len=64, output_len=8, max_output_len=16, rate_fractions="0.5,1.0",
                       sharegpt_rate_fractions="0.5,1.0",
                       seconds_per_rate=1.0, min_requests=6, max_requests=12,
                       unloaded_requests=3, num_kv_blocks=256)
    args = p.parse_args(argv)
    args.workload_names = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workload_names) - {"long-prompt", "sharegpt-like"}
    if unknown or not args.workload_names:
        p.error(f"--workloads: long-prompt and/or sharegpt-like, got {args.workloads!r}")
    return args


def workload_spec(args: argparse.Namespace, name: str) -> WorkloadSpec:
    if name == "long-prompt":
        return WorkloadSpec("random", input_len=args.input_len, output_len=args.output_len)
    return WorkloadSpec("sharegpt-like", max_input_len=4 * args.input_len if args.quick
                        else 1024, max_output_len=args.max_output_len)


def arm_layout(arm: str, cpus: tuple[int, int]) -> dict[str, Any]:
    """The processes of one arm and the cores they are pinned to."""
    first, last = cpus
    router_args = ("--local-prefill-max-tokens", "0")  # the same router in both arms
    if arm == "disaggregated":
        return {"num_prefill": 1, "num_decode": 1, "local_prefill": "never",
                "cpu_affinity": {"prefill-0": (first,), "decode-0": (last,)},
                "router_args": router_args}
    return {"num_prefill": 0, "num_decode": 2, "local_prefill": "always",
            "cpu_affinity": {"decode-0": (first,), "decode-1": (last,)},
            "router_args": router_args}


def unloaded(outcomes: Sequence[Outcome]) -> dict[str, float]:
    done = [o for o in outcomes if o.success]
    if not done:
        raise SystemExit(f"bench.disagg: unloaded requests failed: {outcomes[0].error}")
    return {"ttft_ms": 1000 * statistics.median(o.ttft for o in done),
            "tpot_ms": 1000 * statistics.median(o.tpot or 0.0 for o in done)}


def rates_for(args: argparse.Namespace, workload: str, first_ttft_ms: float) -> list[float]:
    if args.rates:
        return [float(r) for r in args.rates.split(",")]
    capacity = 1000.0 / first_ttft_ms  # one core's prefill capacity, roughly
    fractions = (args.rate_fractions if workload == "long-prompt"
                 else args.sharegpt_rate_fractions)
    return [round(capacity * float(f), 2) for f in fractions.split(",")]


def run_arm(args: argparse.Namespace, arm: str, model_dir: Path, cpus: tuple[int, int],
            plan: dict[str, Any]) -> dict[str, Any]:
    """One arm: its cluster, then per workload its unloaded latencies and the sweep
    (``plan[workload]["rates"]`` is filled by the first arm when not given)."""
    layout = arm_layout(arm, cpus)
    found: dict[str, Any] = {}
    with cluster(model_dir, num_kv_blocks=args.num_kv_blocks, **layout) as running:
        found["configuration"] = describe(running)
        for name in args.workload_names:
            spec, vocab = workload_spec(args, name), plan["vocab_size"]
            warm = Workload(spec, vocab, seed=args.seed + 99).take(2)
            one_by_one(running.router_address, warm)
            alone = unloaded(one_by_one(running.router_address, Workload(
                spec, vocab, seed=args.seed + 1).take(args.unloaded_requests)))
            rates = plan[name].setdefault("rates", rates_for(args, name, alone["ttft_ms"]))
            # the longest a request may take and still meet an SLO from these unloaded
            # latencies, times the cut-off factor: seconds + seconds per output token
            slo = slo_ms(args, alone)
            limit = (args.cut_off_factor * slo["ttft"] / 1000,
                     args.cut_off_factor * slo["tpot"] / 1000)
            sweep = []
            for i, rate in enumerate(rates):
                n = min(args.max_requests, max(args.min_requests,
                                               round(rate * args.seconds_per_rate)))
                requests = Workload(spec, vocab, seed=args.seed + 1000 + i).take(n)
                outcomes, duration = send(running.router_address, requests, request_rate=rate,
                                          seed=args.seed + i, limit_s=cut_off(limit))
                sweep.append((rate, outcomes, duration))
                cut = sum(o.error.startswith(CUT_OFF) for o in outcomes)
                print(f"  {arm:>13} {name}: {rate:6.2f} req/s, {n} requests, "
                      f"{sum(not o.success for o in outcomes) - cut} failed, {cut} cut off",
                      flush=True)
            found[name] = {"unloaded": alone, "sweep": sweep, "limit_s": limit}
    return found


def slo_ms(args: argparse.Namespace, unloaded: dict[str, float]) -> dict[str, float]:
    """The SLO pair: given (``--ttft-slo-ms``, ``--tpot-slo-ms``), else the factors times
    these unloaded latencies."""
    return {"ttft": args.ttft_slo_ms or args.ttft_slo_factor * unloaded["ttft_ms"],
            "tpot": args.tpot_slo_ms or args.tpot_slo_factor * unloaded["tpot_ms"]}


def cut_off(limit: tuple[float, float]) -> Callable[[Request], float]:
    """Seconds after which a request is cut off: ``limit[0] + limit[1] × (tokens − 1)``."""
    return lambda request: limit[0] + limit[1] * max(1, request.max_tokens - 1)


def attainment_parts(outcomes: Sequence[Outcome], slo: dict[str, float]) -> dict[str, float]:
    """Shares of the requests meeting the TTFT target alone and the TPOT target alone."""
    n = len(outcomes)
    return {"ttft_attainment": sum(o.meets({"ttft": slo["ttft"]}) for o in outcomes) / n,
            "tpot_attainment": sum(o.meets({"tpot": slo["tpot"]}) for o in outcomes) / n}


def summarize_workload(name: str, arms: dict[str, Any], args: argparse.Namespace
                       ) -> dict[str, Any]:
    slow = {k: max(arms[a][name]["unloaded"][k] for a in ARMS) for k in ("ttft_ms", "tpot_ms")}
    slo = slo_ms(args, slow)
    out: dict[str, Any] = {
        "slo": {"ttft_ms": slo["ttft"], "tpot_ms": slo["tpot"],
                "ttft_factor": args.ttft_slo_factor, "tpot_factor": args.tpot_slo_factor,
                "given": bool(args.ttft_slo_ms or args.tpot_slo_ms),
                "unloaded": {a: arms[a][name]["unloaded"] for a in ARMS}}}
    for arm in ARMS:
        rates = []
        for rate, outcomes, duration in arms[arm][name]["sweep"]:
            entry = {"request_rate": rate, "num_requests": len(outcomes),
                     "cut_off": sum(o.error.startswith(CUT_OFF) for o in outcomes),
                     **metrics(outcomes, duration, slo_ms=slo),
                     **attainment_parts(outcomes, slo)}
            rates.append(entry)
        limit = arms[arm][name]["limit_s"]
        # cutting off was harmless when no request cut off could still have met the SLO
        out.setdefault("cut_off_could_not_meet_slo", True)
        out["cut_off_could_not_meet_slo"] &= (limit[0] * 1000 >= slo["ttft"]
                                              and limit[1] * 1000 >= slo["tpot"])
        good = [r["request_rate"] for r in rates if r["slo_attainment"] >= ATTAINMENT_TARGET]
        out[arm] = {"max_rate_at_slo": max(good, default=0.0),
                    "top_rate_met_slo": bool(rates) and rates[-1]["slo_attainment"]
                    >= ATTAINMENT_TARGET,
                    "unloaded": arms[arm][name]["unloaded"], "rates": rates}
    colocated = out["colocated"]["max_rate_at_slo"]
    out["goodput_ratio"] = (out["disaggregated"]["max_rate_at_slo"] / colocated
                            if colocated > 0 else None)
    out["goodput_ratio_range"] = ratio_range(out)
    return out


def limit_range(arm: dict[str, Any]) -> tuple[float, float | None]:
    """Where an arm's true limit lies on the swept grid: between its ``max_rate_at_slo``
    (0 when it met the SLO at no rate) and the next rate swept (None: above the top)."""
    rates = [r["request_rate"] for r in arm["rates"]]
    best = arm["max_rate_at_slo"]
    above = [r for r in rates if r > best]
    return best, min(above) if above else None


def ratio_range(out: dict[str, Any]) -> list[float | None]:
    """[low, high] of the true goodput ratio given the grid (None: unbounded)."""
    d_low, d_high = limit_range(out["disaggregated"])
    c_low, c_high = limit_range(out["colocated"])
    low = d_low / c_high if c_high else 0.0  # the colocated arm's limit may be unbounded
    high = d_high / c_low if d_high is not None and c_low > 0 else None
    return [low, high]


def verdict(result: dict[str, Any]) -> list[str]:
    """Per rate: which arm attains more, and which target the other missed."""
    lines = []
    for d, c in zip(result["disaggregated"]["rates"], result["colocated"]["rates"], strict=True):
        da, ca = d["slo_attainment"], c["slo_attainment"]
        if abs(da - ca) < 1e-9:
            lines.append(f"{d['request_rate']:.2f} req/s: a tie ({da:.0%})")
            continue
        win, lose, loser = (("disaggregated", "colocated", c) if da > ca
                            else ("colocated", "disaggregated", d))
        missed = "TPOT" if loser["tpot_attainment"] < loser["ttft_attainment"] else "TTFT"
        lines.append(f"{d['request_rate']:.2f} req/s: {win} ({max(da, ca):.0%} vs "
                     f"{min(da, ca):.0%}); {lose} misses mostly on {missed}")
    return lines


def render(name: str, result: dict[str, Any]) -> str:
    slo = result["slo"]
    rows = []
    for d, c in zip(result["disaggregated"]["rates"], result["colocated"]["rates"], strict=True):
        rows.append([f"{d['request_rate']:.2f}", *(
            x for e in (d, c) for x in (f"{e['slo_attainment']:.0%}", e["median_ttft_ms"],
                                        e["p90_ttft_ms"], e["median_tpot_ms"],
                                        e["p90_tpot_ms"]))])
    head = ["rate", *(f"{a[:5]} {k}" for a in ARMS for k in ("attain", "TTFT p50", "TTFT p90",
                                                             "TPOT p50", "TPOT p90"))]
    ratio = result["goodput_ratio"]
    basis = "given" if slo["given"] else f"{slo['ttft_factor']:g}x / {slo['tpot_factor']:g}x"
    return "\n".join([
        f"== {name}: SLO TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.1f} ms "
        f"({basis}; the slower arm's unloaded "
        f"{max(u['ttft_ms'] for u in slo['unloaded'].values()):.0f} ms / "
        f"{max(u['tpot_ms'] for u in slo['unloaded'].values()):.1f} ms)",
        format_table(rows, head),
        *verdict(result),
        f"max rate at >= 90% attainment: disaggregated "
        f"{result['disaggregated']['max_rate_at_slo']:.2f}, colocated "
        f"{result['colocated']['max_rate_at_slo']:.2f} req/s; goodput_ratio "
        + (f"{ratio:.2f}" if ratio is not None else "n/a (colocated met it at no rate)")
        + " (between {} and {} on this grid of rates)".format(
            *(f"{x:.2f}" if x is not None else "unbounded"
              for x in result["goodput_ratio_range"]))])


def configurations_table(configs: dict[str, Any]) -> str:
    names = sorted({p for c in configs.values() for p in c["processes"]})
    def cell(arm: str, process: str) -> str:
        found = configs[arm]["processes"].get(process)
        if found is None:
            return "-"
        threads = found["torch_threads"]
        return str(found["cpus"]) + (f", {threads} torch thread(s)" if threads else "")

    rows = [[p, *(cell(a, p) for a in ARMS)] for p in names]
    for key in ("local_prefill", "num_kv_blocks_per_worker", "worker_args", "router_args"):
        rows.append([key, *(str(configs[a][key]) for a in ARMS)])
    rows.append(["load client, Redis", "unpinned (any)", "unpinned (any)"])
    return format_table(rows, ["", *ARMS])


def plot(args: argparse.Namespace, results: dict[str, Any], arms: dict[str, Any]) -> None:
    from bench.plots import attainment_plot, cdf_plots

    for name, result in results.items():
        attainment_plot(args.plot / f"{name}_attainment.png",
                        {a: [(r["request_rate"], r["slo_attainment"]) for r in result[a]["rates"]]
                         for a in ARMS}, title=f"{name}: SLO attainment")
        rate = result["cdf_rate"]
        runs = {a: next(o for r, o, _ in arms[a][name]["sweep"] if r == rate) for a in ARMS}
        cdf_plots(args.plot / f"{name}_cdf", runs, title=f"{name} at {rate:g} req/s",
                  slo_ms={"ttft": result["slo"]["ttft_ms"], "tpot": result["slo"]["tpot_ms"]})


def cdf_rate(result: dict[str, Any]) -> float:
    """The rate the CDFs are drawn at: the disaggregated arm's highest rate at SLO (the
    headline point), else the middle of the sweep."""
    rates = [r["request_rate"] for r in result["disaggregated"]["rates"]]
    best = result["disaggregated"]["max_rate_at_slo"]
    return best if best in rates else rates[len(rates) // 2]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cpus = two_cpus()
    model_dir = Path(args.model) if args.model else bench_model(args.quick)
    facts = model_facts(model_dir)
    probe = BandwidthProbe(256 << 20 if args.quick else 1 << 30, threads=1)
    bandwidth = probe.measure()
    probe.release()
    plan: dict[str, Any] = {"vocab_size": facts["vocab_size"],
                            **{name: {} for name in args.workload_names}}
    arms = {}
    for arm in ARMS:  # the disaggregated arm first: its unloaded TTFT sets default rates
        print(f"{arm}: {arm_layout(arm, cpus)['cpu_affinity']}", flush=True)
        arms[arm] = run_arm(args, arm, model_dir, cpus, plan)
    results = {name: summarize_workload(name, arms, args) for name in args.workload_names}
    for result in results.values():
        result["cdf_rate"] = cdf_rate(result)
    first = results[args.workload_names[0]]
    configs = {a: arms[a]["configuration"] for a in ARMS}
    report: dict[str, Any] = {
        "workload": args.workload_names[0], **first,
        "workloads": results, "configurations": configs,
        "machine": {**machine_info(), "bandwidth_gbps_1_thread": bandwidth},
        "model": {**facts, "dtype": "float32"},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}}
    print(configurations_table(configs))
    for name, result in results.items():
        print(render(name, result))
    print(f"machine: {report['machine']}")
    print(f"model: {facts['parameters'] / 1e6:.1f}M parameters, fp32, one torch thread per "
          f"worker, {model_dir}")
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(args, results, arms)
    return report


if __name__ == "__main__":
    main()
