"""The planner against fixed splits, on the same two cores, under a mix that shifts.

    python -m bench.planner [--json out.json] [--seed S] [--seeds N] [--plot plots/] [--quick]

Three arms, each its own cluster of two workers pinned one per core (``bench.disagg``'s
layout: ``bench55m``, fp32, one torch thread per worker), one router with
``--local-prefill fallback`` (a cluster whose only prefill worker became a decode worker
still serves), on the same seeded arrivals:

- ``disaggregated``: 1 prefill + 1 decode worker, fixed;
- ``colocated``: 2 decode workers prefilling locally, fixed;
- ``planner``: starts 1 + 1, with ``pdserve planner`` (``--min-prefill 0``) switching
  roles live.

The routers run without conditional disaggregation (``--local-prefill-max-tokens 0``):
its queue rule would make the fixed split adaptive on its own.

The workload: ``long-prompt`` (1,024 → 64 tokens), then ``sharegpt-like`` made
decode-heavy (ShareGPT's length distribution clipped to prompts of at most 256 and outputs
of at most 256 tokens), then ``long-prompt`` again, ``--phase-seconds`` each (Poisson
arrivals). Before the arms, the disaggregated layout serves a few requests of each mix one
at a time: the unloaded latencies give the SLO (TTFT ≤ ``--ttft-slo-factor`` × the long
prompts' unloaded TTFT, TPOT ≤ ``--tpot-slo-factor`` × the larger unloaded TPOT;
``--ttft-slo-ms`` / ``--tpot-slo-ms`` instead), and the two capacities the rates are
fractions of:

- one prefill worker's, ``1 / unloaded TTFT`` of the long prompts: their rate is
  ``--long-fraction`` [0.6] of it. One prefill worker keeps up, and the decode worker's
  streams never wait for a prefill; a colocated worker stops its streams for each
  1,024-token prefill it takes;
- one decode worker's, on the decode-heavy mix itself: the streams at which its median
  TPOT reaches the SLO, read between closed-loop probes of the mix through the cluster
  (``PROBES`` of them at most, each keeping a number of requests in flight, the first
  ``PROBE_STREAMS`` (half with ``--quick``), each next one where the points so far put
  the SLO; of each, the requests that ended before its last one was sent, so every one
  ran with every stream busy, a failed one counting as past the SLO), over a request's
  mean latency there (Little's law). Its rate is ``--sharegpt-fraction``
  [1.0] of it: one decode worker runs at its SLO's edge and, with Poisson arrivals,
  past it, while two colocated workers share it. (Before, this capacity was extrapolated
  from four short streams' cost in a step, taken as linear up to the streams the SLO
  allows: one run set the mix at 6.91 req/s from it, and every arm missed that whole
  phase.)

So each phase has its own better static arm. With the earlier workload and rates
(512-token prompts at 0.5 of the prefill capacity, ShareGPT-like up to 1,024 → 128 tokens
at 0.6 of it) disaggregation was ahead in all three phases, by 0.23, 0.09 and 0.56; the
JSON says how far apart the arms came out. Each seed runs the arms in another order
(``order`` in the JSON): on this machine an arm's place in the run moved an identical
layout's attainment by 0.1-0.4. The planner's capacity model is a ``bench.profile`` of
the same model measured first (``--profile`` to reuse one).

A request meets the SLO when it completes within both targets; attainment is the share of
the requests sent that did (one unfinished ``--cut-off-factor`` times the longest it could
take and meet the SLO is cancelled and misses it). ``failed`` counts the requests that
ended in an error other than that cut-off. Goal: the planner's attainment ≥ the better
static arm's + 0.10, with 0 failed and no role change undone within the planner's dwell.

``--json PATH``: ``arms.{disaggregated,colocated,planner}.slo_attainment`` (``overall``,
``by_phase``), ``.failed``, ``arms.planner.role_changes`` (``{t, worker, from, to,
reason}``, ``t`` in seconds from the first arrival), the SLO and rates used; ``--seeds N``
repeats the run on seeds S.. and reports the spread; ``--plot DIR`` writes attainment over
time (10 s bins) with the role changes marked. About 11 minutes by default; ``--quick``
(the tiny model, 8 s phases) is what the tests run.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.clusters import bench_model, cluster, describe, one_by_one, send, two_cpus
from bench.common import format_table, machine_info, model_facts, write_json
from loadtest.workloads import Request, Workload, WorkloadSpec
from sim.metrics import CUT_OFF, Outcome

ARMS = ("disaggregated", "colocated", "planner")
PHASES = ("long-prompt", "sharegpt-like", "long-prompt")
GAIN_GOAL = 0.10
# the arms' routers: conditional disaggregation off, so a split stays the split (its queue
# rule alone prefills on the decode worker whenever the prefill queue is the longer wait:
# the static disaggregated arm would no longer be one)
ARM_ROUTER_ARGS = ("--local-prefill-max-tokens", "0")
SWITCHED = re.compile(r"^(\S+ \S+) .*switched (\S+): (\w+) -> (\w+): (.*)$")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="runs, on seeds --seed, --seed + 1, ...")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", type=Path, help="reuse this bench.profile JSON")
    p.add_argument("--phase-seconds", type=float)
    p.add_argument("--long-fraction", type=float, default=0.6,
                   help="the long prompts' rate, of one prefill worker's capacity")
    p.add_argument("--sharegpt-fraction", type=float, default=1.0,
                   help="the decode-heavy mix's rate, of one decode worker's capacity")
    p.add_argument("--ttft-slo-factor", type=float, default=5.0)
    p.add_argument("--tpot-slo-factor", type=float, default=1.5)
    p.add_argument("--ttft-slo-ms", type=float)
    p.add_argument("--tpot-slo-ms", type=float)
    p.add_argument("--cut-off-factor", type=float, default=3.0)
    p.add_argument("--num-kv-blocks", type=int, default=512, help="per worker")
    p.add_argument("--interval", type=float, default=2.0, help="the planner's --interval")
    p.add_argument("--window", type=float, default=10.0, help="the planner's --window")
    p.add_argument("--dwell", type=float, default=20.0, help="the planner's --dwell")
    args = p.parse_args(argv)
    if args.phase_seconds is None:
        args.phase_seconds = 8.0 if args.quick else 60.0
    return args


def workload_spec(name: str, quick: bool) -> WorkloadSpec:
    if name == "long-prompt":
        return WorkloadSpec("random", input_len=128 if quick else 1024,
                            output_len=16 if quick else 64)
    return WorkloadSpec("sharegpt-like", max_input_len=128 if quick else 256,
                        max_output_len=32 if quick else 256)


def arm_layout(arm: str, cpus: tuple[int, int]) -> dict[str, Any]:
    first, last = cpus
    if arm == "colocated":
        return {"num_prefill": 0, "num_decode": 2, "local_prefill": "always",
                "cpu_affinity": {"decode-0": (first,), "decode-1": (last,)},
                "router_args": ARM_ROUTER_ARGS}
    # a split is the split: no conditional disaggregation (``ARM_ROUTER_ARGS``)
    return {"num_prefill": 1, "num_decode": 1, "local_prefill": "fallback",
            "cpu_affinity": {"prefill-0": (first,), "decode-0": (last,)},
            "router_args": ARM_ROUTER_ARGS}


def measure_profile(args: argparse.Namespace, model_dir: Path, out: Path) -> Path:
    """A ``bench.profile`` of the model (step times only: the planner's model needs no
    handoff figures), in a process of its own, pinned like a worker."""
    cmd = [sys.executable, "-m", "bench.profile", "--model", str(model_dir), "--threads", "1",
           "--no-handoff", "--json", str(out), *(["--quick"] if args.quick else [])]
    print(f"measuring the planner's profile: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def calibrate(args: argparse.Namespace, model_dir: Path, vocab: int, cpus: tuple[int, int]
              ) -> dict[str, Any]:
    """Unloaded latencies of both mixes on the disaggregated layout, and the streams its
    decode worker holds within the TPOT SLO on the decode-heavy mix: the SLO, and the
    capacities the rates are fractions of (the module docstring)."""
    alone: dict[str, dict[str, float]] = {}
    with cluster(model_dir, num_kv_blocks=args.num_kv_blocks,
                 **arm_layout("disaggregated", cpus)) as running:
        for name in ("long-prompt", "sharegpt-like"):
            spec = workload_spec(name, args.quick)
            one_by_one(running.router_address, Workload(spec, vocab, seed=99).take(2))
            done = [o for o in one_by_one(running.router_address,
                                          Workload(spec, vocab, seed=1).take(6)) if o.success]
            if not done:
                raise SystemExit(f"bench.planner: unloaded {name} requests failed")
            alone[name] = {"ttft_ms": 1000 * statistics.median(o.ttft for o in done),
                           "tpot_ms": 1000 * statistics.median(o.tpot or 0.0 for o in done)}
        slo = {"ttft": args.ttft_slo_ms or args.ttft_slo_factor * alone["long-prompt"]["ttft_ms"],
               "tpot": args.tpot_slo_ms or args.tpot_slo_factor * max(
                   a["tpot_ms"] for a in alone.values())}
        streams, probes = decode_streams(running.router_address, vocab, args.quick,
                                         alone["sharegpt-like"]["tpot_ms"], slo["tpot"])
    capacity = {"prefill": 1000.0 / alone["long-prompt"]["ttft_ms"],
                "decode": decode_capacity(args, vocab, streams, probes, slo["tpot"])}
    rates = {"long-prompt": round(args.long_fraction * capacity["prefill"], 2),
             "sharegpt-like": round(args.sharegpt_fraction * capacity["decode"], 2)}
    return {"unloaded": alone, "slo_ms": slo, "decode_streams": streams,
            "decode_probes": [asdict(p) for p in probes], "capacity_req_s": capacity,
            "rates": rates}


PROBE_STREAMS = 8  # the first closed-loop probe of the decode-heavy mix (--quick: 4)
PROBES = 3  # closed-loop probes in all, each near where the last ones put the SLO
REQUESTS_PER_STREAM = 3  # a probe sends this many requests per stream it keeps open
MAX_STREAMS = 64  # the most a decode step is taken to hold


@dataclass(frozen=True)
class Probe:
    """The decode-heavy mix through the cluster with ``streams`` requests kept in flight
    (the next sent as one finishes): the median TPOT and mean TTFT of the requests that
    finished while that many were in flight (``full_load``), and the requests finished a
    second."""

    streams: int
    tpot_ms: float
    ttft_ms: float
    req_s: float


def probe(address: str, vocab: int, quick: bool, streams: int, seed: int) -> Probe:
    """One closed-loop probe of the decode-heavy mix at ``streams`` in flight."""
    requests = Workload(workload_spec("sharegpt-like", quick), vocab, seed=seed).take(
        REQUESTS_PER_STREAM * streams)
    outcomes, duration = send(address, requests, request_rate=float("inf"),
                              max_concurrency=streams)
    done = [o for o in outcomes if o.success]
    if not done:
        raise SystemExit(f"bench.planner: the decode-heavy mix at {streams} streams could not "
                         "be measured (requests failed)")
    loaded = full_load(outcomes)
    # a request that failed counts as past the SLO (infinite TPOT), not as absent
    tpots = [math.inf if not o.success else o.tpot or 0.0 for o in loaded]
    return Probe(streams, 1000 * statistics.median(tpots),
                 1000 * statistics.fmean(o.ttft for o in loaded if o.success),
                 len(done) / duration)


def full_load(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The requests of a closed-loop run that ended before its last request was sent:
    each ran with every stream busy (after that, fewer run, and faster). At least the
    one that ended first."""
    last_sent = max(o.sent_at for o in outcomes)
    ended = sorted(outcomes, key=lambda o: o.sent_at + o.latency)
    return [o for o in ended if o.sent_at + o.latency <= last_sent] or ended[:1]


def streams_at(points: Sequence[tuple[float, float]], tpot_slo_ms: float) -> float:
    """The streams at which the median TPOT reaches the SLO, from measured ``(streams,
    median TPOT ms)`` points: on the line from the most streams within the SLO to the
    fewest past it with more streams (where noise put every point past the SLO at fewer
    streams, the most streams within it), else through the two points nearest the SLO;
    within 1 .. ``MAX_STREAMS`` and, past the points, at most twice the most streams
    measured. A line that does not rise gives the side of the SLO the points are on."""
    points = sorted(set(points))
    below = [p for p in points if p[1] <= tpot_slo_ms]
    above = [p for p in points if p[1] > tpot_slo_ms]
    if below and above:
        low = max(below)
        higher = [p for p in above if p[0] > low[0]]
        if not higher:
            return low[0]
        pair = [low, min(higher)]
    else:
        pair = sorted(points, key=lambda p: abs(p[1] - tpot_slo_ms))[:2]
    ceiling = min(MAX_STREAMS, 2 * max(p[0] for p in points))
    if len(pair) < 2 or pair[0][0] == pair[1][0]:
        return ceiling if not above else 1.0
    (n0, t0), (n1, t1) = pair
    slope = (t1 - t0) / (n1 - n0)
    if slope <= 0:
        return ceiling if not above else 1.0
    return min(ceiling, max(1.0, n0 + (tpot_slo_ms - t0) / slope))


def decode_streams(address: str, vocab: int, quick: bool, unloaded_tpot_ms: float,
                   tpot_slo_ms: float) -> tuple[float, list[Probe]]:
    """The streams one decode worker holds within the TPOT SLO on the decode-heavy mix,
    measured through the cluster: from the unloaded TPOT (one stream) and ``PROBES``
    closed-loop probes, the first at ``PROBE_STREAMS``, each next one where the points so
    far put the SLO (``streams_at``)."""
    points = [(1.0, unloaded_tpot_ms)]
    probes: list[Probe] = []
    streams = PROBE_STREAMS // 2 if quick else PROBE_STREAMS
    for i in range(PROBES):
        measured = probe(address, vocab, quick, streams, seed=11 + i)
        probes.append(measured)
        points.append((float(measured.streams), measured.tpot_ms))
        print(f"  decode-heavy mix, {measured.streams} streams: median TPOT "
              f"{measured.tpot_ms:.1f} ms, mean TTFT {measured.ttft_ms:.0f} ms, "
              f"{measured.req_s:.2f} req/s", flush=True)
        streams = max(2, round(streams_at(points, tpot_slo_ms)))
        if streams in {p.streams for p in probes}:
            break
    return streams_at(points, tpot_slo_ms), probes


def decode_capacity(args: argparse.Namespace, vocab: int, streams: float,
                    probes: Sequence[Probe], tpot_slo_ms: float) -> float:
    """Requests a second of the decode-heavy mix one decode worker serves within the TPOT
    SLO, by Little's law: ``streams`` (``decode_streams``) over a request's mean latency
    there, the mean TTFT of the probe nearest ``streams`` plus the mix's mean output (of a
    sample of it) less one token at the SLO's TPOT."""
    sample = Workload(workload_spec("sharegpt-like", args.quick), vocab, seed=7).take(200)
    output = statistics.fmean(r.max_tokens for r in sample)
    nearest = min(probes, key=lambda p: abs(p.streams - streams))
    return 1000 * streams / (nearest.ttft_ms + max(0.0, output - 1) * tpot_slo_ms)


def phased_requests(args: argparse.Namespace, vocab: int, rates: dict[str, float],
                    seed: int) -> list[list[Request]]:
    return [Workload(workload_spec(name, args.quick), vocab, seed=seed * 100 + i).take(
        max(1, round(rates[name] * args.phase_seconds))) for i, name in enumerate(PHASES)]


def run_arm(args: argparse.Namespace, arm: str, model_dir: Path, cpus: tuple[int, int],
            plan: dict[str, Any], profile: Path, seed: int) -> dict[str, Any]:
    """One arm: its cluster, then the three phases, each sent from its start time."""
    slo = plan["slo_ms"]
    planner_args = None if arm != "planner" else (
        "--profile", str(profile), "--ttft-slo-ms", f"{slo['ttft']:.1f}",
        "--tpot-slo-ms", f"{slo['tpot']:.2f}", "--interval", str(args.interval),
        "--window", str(args.window), "--dwell", str(args.dwell), "--min-prefill", "0")
    limit = (args.cut_off_factor * slo["ttft"] / 1000, args.cut_off_factor * slo["tpot"] / 1000)
    phases = phased_requests(args, plan["vocab_size"], plan["rates"], seed)
    results: list[tuple[list[Outcome], float] | None] = [None] * len(phases)
    with cluster(model_dir, num_kv_blocks=args.num_kv_blocks, planner_args=planner_args,
                 **arm_layout(arm, cpus)) as running:
        configuration = describe(running)
        one_by_one(running.router_address, phases[0][:1] + phases[1][:1])  # warm both paths
        start_wall, start = time.time(), time.monotonic()

        def phase(i: int) -> None:
            time.sleep(max(0.0, start + i * args.phase_seconds - time.monotonic()))
            name = PHASES[i]
            results[i] = send(running.router_address, phases[i], request_rate=plan["rates"][name],
                              seed=seed * 10 + i, limit_s=lambda r: limit[0] + limit[1] * max(
                                  1, r.max_tokens - 1))

        threads = [threading.Thread(target=phase, args=(i,)) for i in range(len(phases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        log = running.planners[0].log_path.read_text() if running.planners else ""
    outcomes = [(i, o) for i, r in enumerate(results) if r is not None for o in r[0]]
    for i, o in outcomes:
        o.sent_at += i * args.phase_seconds  # from the first arrival
    return summarize_arm(arm, outcomes, slo, configuration, role_changes(log, start_wall))


def role_changes(log: str, start_wall: float) -> list[dict[str, Any]]:
    """The planner's switches from its log: ``{t, worker, from, to, reason}``."""
    found = []
    for line in log.splitlines():
        if (m := SWITCHED.match(line)) is not None:
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append({"t": round(at - start_wall, 1), "worker": m.group(2),
                          "from": m.group(3), "to": m.group(4), "reason": m.group(5)})
    return found


def summarize_arm(arm: str, outcomes: Sequence[tuple[int, Outcome]], slo: dict[str, float],
                  configuration: dict[str, Any], changes: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    def attain(items: Sequence[Outcome]) -> float:
        return sum(o.meets(slo) for o in items) / len(items) if items else 0.0

    everything = [o for _, o in outcomes]
    out: dict[str, Any] = {
        "configuration": configuration,
        "slo_attainment": {"overall": attain(everything), "by_phase": [
            attain([o for i, o in outcomes if i == k]) for k in range(len(PHASES))]},
        "requests": len(everything),
        "failed": sum(not o.success and not o.error.startswith(CUT_OFF) for o in everything),
        "cut_off": sum(o.error.startswith(CUT_OFF) for o in everything),
        "over_time": over_time(everything, slo)}
    if arm == "planner":
        out["role_changes"] = changes
    return out


def over_time(outcomes: Sequence[Outcome], slo: dict[str, float], bin_s: float = 10.0
              ) -> list[tuple[float, float]]:
    """(bin start, attainment of the requests sent in it)."""
    bins: dict[int, list[Outcome]] = {}
    for o in outcomes:
        bins.setdefault(int(o.sent_at // bin_s), []).append(o)
    return [(k * bin_s, sum(o.meets(slo) for o in v) / len(v)) for k, v in sorted(bins.items())]


def undone_within(changes: Sequence[dict[str, Any]], dwell_s: float) -> list[str]:
    """Changes reversed (the same worker back) sooner than ``dwell_s`` after them."""
    bad = []
    for a, b in zip(changes, changes[1:]):
        if b["worker"] == a["worker"] and b["to"] == a["from"] and b["t"] - a["t"] < dwell_s:
            bad.append(f"{a['worker']} at {a['t']}s and {b['t']}s")
    return bad


def verdict(run: dict[str, Any], dwell_s: float) -> dict[str, Any]:
    arms = run["arms"]
    static = max(arms[a]["slo_attainment"]["overall"] for a in ("disaggregated", "colocated"))
    planner = arms["planner"]["slo_attainment"]["overall"]
    apart = [abs(d - c) for d, c in zip(arms["disaggregated"]["slo_attainment"]["by_phase"],
                                        arms["colocated"]["slo_attainment"]["by_phase"],
                                        strict=True)]
    undone = undone_within(arms["planner"]["role_changes"], dwell_s)
    return {"planner_minus_best_static": planner - static,
            "static_arms_apart_by_phase": apart, "undone_within_dwell": undone,
            "goal_met": planner >= static + GAIN_GOAL and not undone and all(
                arms[a]["failed"] == 0 for a in ARMS)}


def render(run: dict[str, Any]) -> str:
    rows = [[arm, f"{a['slo_attainment']['overall']:.2f}",
             *(f"{x:.2f}" for x in a["slo_attainment"]["by_phase"]), a["failed"], a["cut_off"]]
            for arm, a in run["arms"].items()]
    table = format_table(rows, ["arm", "attainment", *(f"{i + 1}: {p}" for i, p in
                                                       enumerate(PHASES)), "failed", "cut off"])
    changes = "\n".join(f"  {c['t']:7.1f}s {c['worker']}: {c['from']} -> {c['to']}: {c['reason']}"
                        for c in run["arms"]["planner"]["role_changes"]) or "  (none)"
    v = run["verdict"]
    return (f"{table}\nrole changes:\n{changes}\nplanner - best static: "
            f"{v['planner_minus_best_static']:+.2f} (goal +{GAIN_GOAL:.2f}); static arms apart "
            f"by phase: {', '.join(f'{x:.2f}' for x in v['static_arms_apart_by_phase'])}; "
            f"goal {'met' if v['goal_met'] else 'NOT met'}")


def plot(path: Path, run: dict[str, Any]) -> Path:
    from bench.plots import _pyplot

    plt = _pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4))
    for arm, a in run["arms"].items():
        ax.plot([t for t, _ in a["over_time"]], [x for _, x in a["over_time"]], marker=".",
                label=arm)
    for change in run["arms"]["planner"]["role_changes"]:
        ax.axvline(change["t"], color="grey", linestyle=":")
    ax.set_xlabel("seconds from the first arrival (dotted: the planner's role changes)")
    ax.set_ylabel("SLO attainment (10 s bins)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir, cpus = bench_model(args.quick), two_cpus()
    facts = model_facts(model_dir)
    out_dir = (args.json.parent if args.json else Path.cwd())
    profile = args.profile or measure_profile(args, model_dir, out_dir / "planner-profile.json")
    plan = {"vocab_size": facts["vocab_size"], **calibrate(args, model_dir, facts["vocab_size"],
                                                           cpus)}
    capacity = plan["capacity_req_s"]
    print(f"SLO: TTFT <= {plan['slo_ms']['ttft']:.0f} ms, TPOT <= {plan['slo_ms']['tpot']:.1f} ms;"
          f" rates {plan['rates']} (capacity: one prefill worker {capacity['prefill']:.2f} "
          f"req/s of long prompts, one decode worker {capacity['decode']:.2f} of the "
          f"decode-heavy mix, {plan['decode_streams']:.1f} streams within the TPOT SLO)", flush=True)
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        k = (seed - args.seed) % len(ARMS)  # each seed runs the arms in another order:
        order = ARMS[k:] + ARMS[:k]  # an arm's place in the run moves its attainment here
        run: dict[str, Any] = {"seed": seed, "order": list(order), "arms": {}}
        for arm in order:
            print(f"seed {seed}: {arm} ...", flush=True)
            run["arms"][arm] = run_arm(args, arm, model_dir, cpus, plan, profile, seed)
        run["arms"] = {arm: run["arms"][arm] for arm in ARMS}
        run["verdict"] = verdict(run, args.dwell)
        print(render(run), flush=True)
        runs.append(run)
    result = {"machine": machine_info(), "model": facts, "plan": plan,
              "phases": list(PHASES), "phase_seconds": args.phase_seconds,
              "planner": {"interval_s": args.interval, "window_s": args.window,
                          "dwell_s": args.dwell, "profile": str(profile)},
              "arms": runs[0]["arms"], "verdict": runs[0]["verdict"], "runs": runs}
    if len(runs) > 1:
        gains = [r["verdict"]["planner_minus_best_static"] for r in runs]
        result["spread"] = {"planner_minus_best_static": {"min": min(gains), "max": max(gains),
                                                          "mean": statistics.mean(gains)}}
        print(f"over {len(runs)} seeds: planner - best static {min(gains):+.2f} .. "
              f"{max(gains):+.2f}", flush=True)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        print(f"wrote {plot(args.plot / 'planner-attainment.png', runs[0])}")
    return result


if __name__ == "__main__":
    main()
