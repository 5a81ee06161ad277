"""Fleet sizing on derived GPU profiles: for each GPU count and workload, the best layout
(prefill:decode split and TP sizes) and its goodput against colocated serving on the same
GPUs, found with the simulator (``sim``: pdserve's own router and scheduler code on a
virtual clock).

    python -m bench.capacity --json capacity.json --plot plots/     # about 15 minutes
    python -m bench.capacity --simulate-up-to 64 --candidates 3      # hours

The profile: ``sim.roofline``'s derived Llama-3-8B on H100 SXM at TP 1, 2 and 4 (datasheet
figures and stated assumptions, never a measurement; ``--profile`` for another). The
workloads (``WORKLOADS``): long-prompt RAG (4,000 ± 1,000 tokens in, 200 out; TTFT ≤ 1 s,
TPOT ≤ 50 ms), chat (ShareGPT-like; TTFT ≤ 500 ms, TPOT ≤ 50 ms) and long generation (500
in, 1,000 out; TTFT ≤ 1 s, TPOT ≤ 25 ms). Goodput: the highest Poisson rate at which 90%
of the requests meet both targets (``bench.fleet``).

For each GPU count up to ``--simulate-up-to`` every layout is enumerated
(``bench.fleet.layouts``); the planner's capacity model ranks them, and the simulator
measures the best ``--candidates`` disaggregated layouts and the best colocated one, and
the best two of the next smaller count, replicated (the model can rank them low). Above
it, a fleet is the largest simulated count's best layouts replicated (independent cells,
each behind its own router), so goodput scales with the cell count: that is an assumption,
marked ``"method": "replicated"`` in the JSON, not a simulation.

``--json PATH``: ``profile``, ``workloads`` (their SLOs), and ``fleets[workload][gpus]``:
``best`` (the best disaggregated layout, its goodput and goodput per GPU), ``colocated``
(likewise), ``ratio`` (best disaggregated over colocated goodput), ``method``
(``simulated`` / ``replicated``), ``candidates`` (every simulated layout with its
estimate and probes). ``--plot DIR``: goodput per GPU against GPU count, per workload.
``--diurnal``: the planner against a fixed split over a compressed day on
``--diurnal-workers`` workers (``bench.diurnal``), in the JSON as ``diurnal``.
``--quick``: 2 GPUs simulated and 4 replicated, the chat workload, short runs, and with
``--diurnal`` 4 workers and 1-second segments (the tests).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import format_table, machine_info, write_json
from bench.diurnal import run_day
from bench.fleet import FleetWorkload, Layout, estimate, goodput, layouts
from loadtest.workloads import WorkloadSpec
from sim.profile import Profile, load
from sim.roofline import GPUS, MODELS, derive

WORKLOADS = {
    "rag": FleetWorkload("rag", WorkloadSpec("random", input_len=4000, output_len=200,
                                             range_ratio=0.25, max_input_len=8192),
                         ttft_ms=1000, tpot_ms=50),
    "chat": FleetWorkload("chat", WorkloadSpec("sharegpt-like"), ttft_ms=500, tpot_ms=50),
    "long-generation": FleetWorkload(
        "long-generation", WorkloadSpec("random", input_len=500, output_len=1000,
                                        max_output_len=2048), ttft_ms=1000, tpot_ms=25),
}
FLEET_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
SCHEDULER = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, help="a sim.profile JSON (default: derived "
                                                "Llama-3-8B on H100)")
    p.add_argument("--tps", default="1,2,4", help="TP sizes to consider")
    p.add_argument("--gpus", default=",".join(map(str, FLEET_GPUS)), help="fleet sizes")
    p.add_argument("--simulate-up-to", type=int, default=16,
                   help="simulate fleets up to this many GPUs; larger ones replicate it")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--candidates", type=int, default=2,
                   help="disaggregated layouts simulated per fleet (the model's best)")
    p.add_argument("--duration", type=float, default=15.0,
                   help="virtual seconds of arrivals per simulated run")
    p.add_argument("--max-prompts", type=int, default=20000, help="requests per run, at most")
    p.add_argument("--probes", type=int, default=5, help="simulated runs per layout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--diurnal", action="store_true",
                   help="also run the planner against a fixed split over a compressed day "
                        "(bench.diurnal)")
    p.add_argument("--diurnal-only", action="store_true", help="--diurnal without the search")
    p.add_argument("--diurnal-workers", type=int, default=64)
    p.add_argument("--diurnal-load", type=float, default=0.7,
                   help="each workload's peak, as a share of the best split's capacity")
    p.add_argument("--segment-seconds", type=float, default=10.0,
                   help="virtual seconds of each of the day's segments")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="write the plots here")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    try:
        args.tp_sizes = sorted({int(t) for t in args.tps.split(",")})
        args.fleet_gpus = sorted({int(n) for n in args.gpus.split(",")})
    except ValueError:
        p.error("--tps and --gpus take comma-separated integers")
    args.names = [w for w in args.workloads.split(",") if w]
    if unknown := [w for w in args.names if w not in WORKLOADS]:
        p.error(f"unknown workloads {unknown}; known: {', '.join(WORKLOADS)}")
    if args.diurnal_only:
        args.diurnal, args.names = True, []
    if args.quick:
        args.fleet_gpus, args.simulate_up_to, args.names = [2, 4], 2, ["chat"]
        args.candidates, args.duration, args.max_prompts, args.probes = 1, 2.0, 300, 3
        args.diurnal_workers, args.segment_seconds = 4, 1.0
    if args.names and not any(n <= args.simulate_up_to for n in args.fleet_gpus):
        p.error("--simulate-up-to must cover the smallest of --gpus")
    return args


def search(profile: Profile, n: int, workload: FleetWorkload, args: argparse.Namespace,
           smaller: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The simulated best disaggregated and colocated layouts of ``n`` GPUs (None when
    ``n`` has no layout of one kind or the other with these TP sizes). The best layouts of
    a ``smaller`` simulated fleet, replicated to ``n`` GPUs, are candidates too: the
    model's ranking alone can miss them."""
    ranked = sorted(((estimate(profile, layout, workload,
                               max_num_batched_tokens=SCHEDULER["max_num_batched_tokens"]),
                      layout) for layout in layouts(n, args.tp_sizes)),
                    key=lambda pair: -pair[0])
    chosen = [pair for pair in ranked if not pair[1].colocated][:args.candidates]
    chosen += [pair for pair in ranked if pair[1].colocated][:1]
    if smaller is not None and n % smaller["gpus"] == 0:
        for kind in ("best", "colocated"):
            layout = Layout(**smaller[kind]["layout"]).scaled(n // smaller["gpus"])
            if all(layout != pair[1] for pair in chosen):
                chosen.append((smaller[kind]["goodput"] * n / smaller["gpus"], layout))
    if len({pair[1].colocated for pair in chosen}) < 2:
        return None  # no disaggregated, or no colocated, layout of n GPUs
    candidates = []
    for guess, layout in chosen:
        found = goodput(profile, layout, workload, guess, duration_s=args.duration,
                        max_prompts=args.max_prompts, probes=args.probes, seed=args.seed,
                        scheduler=SCHEDULER, progress=print)
        candidates.append({"layout": _layout(layout), "label": str(layout),
                           "estimate": guess, **found})
    best = max((c for c in candidates if c["layout"]["num_prefill"]),
               key=lambda c: c["goodput"])
    colocated = max((c for c in candidates if not c["layout"]["num_prefill"]),
                    key=lambda c: c["goodput"])
    return _fleet(n, best, colocated, "simulated", candidates)


def replicate(cell: dict[str, Any], n: int) -> dict[str, Any]:
    """The fleet of ``n`` GPUs made of copies of a simulated ``cell``."""
    factor = n // cell["gpus"]

    def scaled(entry: dict[str, Any]) -> dict[str, Any]:
        layout = Layout(**entry["layout"]).scaled(factor)
        return {"layout": _layout(layout), "label": str(layout),
                "goodput": entry["goodput"] * factor}

    return _fleet(n, scaled(cell["best"]), scaled(cell["colocated"]),
                  f"replicated {factor} x the {cell['gpus']}-GPU fleet", [])


def _fleet(n: int, best: dict[str, Any], colocated: dict[str, Any], method: str,
           candidates: list[dict[str, Any]]) -> dict[str, Any]:
    def entry(c: dict[str, Any]) -> dict[str, Any]:
        return {"layout": c["layout"], "label": c["label"], "goodput": c["goodput"],
                "goodput_per_gpu": c["goodput"] / n}

    ratio = best["goodput"] / colocated["goodput"] if colocated["goodput"] else float("inf")
    return {"gpus": n, "best": entry(best), "colocated": entry(colocated), "ratio": ratio,
            "method": method, "candidates": candidates}


def _layout(layout: Layout) -> dict[str, int]:
    return {"num_prefill": layout.num_prefill, "prefill_tp": layout.prefill_tp,
            "num_decode": layout.num_decode, "decode_tp": layout.decode_tp}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    profile = load(args.profile) if args.profile else derive(
        MODELS["llama-3-8b"], GPUS["h100"], args.tp_sizes)
    started = time.perf_counter()
    fleets: dict[str, dict[int, dict[str, Any]]] = {}
    for name in args.names:
        workload, cell = WORKLOADS[name], None
        fleets[name] = {}
        for n in args.fleet_gpus:
            if n <= args.simulate_up_to:
                print(f"{name}: {n} GPUs ...", flush=True)
                found = search(profile, n, workload, args, cell)
                if found is None:
                    print(f"{name}: {n} GPUs skipped: no disaggregated and colocated layout "
                          f"of TP sizes {args.tp_sizes}")
                    continue
                fleets[name][n] = cell = found
            elif cell is not None and n % cell["gpus"] == 0:
                fleets[name][n] = replicate(cell, n)
            else:
                print(f"{name}: {n} GPUs skipped: not a multiple of the largest simulated "
                      "fleet")
    rows = [[name, n, f["best"]["label"], f"{f['best']['goodput']:.1f}",
             f["colocated"]["label"], f"{f['colocated']['goodput']:.1f}", f"{f['ratio']:.2f}",
             "sim" if f["method"] == "simulated" else "x cells",
             "" if all(c["bracketed"] for c in f["candidates"]) else "not bracketed"]
            for name, by_n in fleets.items() for n, f in by_n.items()]
    if rows:
        print(format_table(rows, ["workload", "GPUs", "best disaggregated", "req/s",
                                  "best colocated", "req/s", "ratio", "method", ""]))
    result = {"profile": {"source": profile.source, "description": profile.description},
              "workloads": {n: {"ttft_ms": WORKLOADS[n].ttft_ms, "tpot_ms": WORKLOADS[n].tpot_ms,
                                "spec": vars(WORKLOADS[n].spec)} for n in args.names},
              "attainment": 0.9, "scheduler": SCHEDULER, "tps": args.tp_sizes,
              "fleets": fleets,
              "machine": machine_info()}
    if args.diurnal:
        day = run_day(profile, WORKLOADS, num_workers=args.diurnal_workers,
                      load=args.diurnal_load, segment_s=args.segment_seconds, seed=args.seed,
                      scheduler=SCHEDULER)
        result["diurnal"] = day
        print(format_table([[arm, f"{a['slo_attainment']:.3f}",
                             " ".join(f"{v:.2f}" for v in a["by_segment"]), a["failed"],
                             len(a["role_changes"]), len(a["scale_steps"]),
                             f"{a['worker_seconds']:.0f}"] for arm, a in day["arms"].items()],
                           ["arm", "attainment", "by segment", "failed", "role changes",
                            "scale steps", "worker-s"]))
    result["wall_s"] = time.perf_counter() - started
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.plot:
        _plot(args.plot, fleets)
    return result


def _plot(out_dir: Path, fleets: dict[str, dict[int, dict[str, Any]]]) -> None:
    from bench.plots import _pyplot

    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, by_n in fleets.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = sorted(by_n)
        for kind in ("best", "colocated"):
            ax.plot(sizes, [by_n[n][kind]["goodput_per_gpu"] for n in sizes], marker="o",
                    label="disaggregated" if kind == "best" else "colocated")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.set_title(f"{name}: goodput at 90% SLO attainment")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"capacity-{name}.png", dpi=110)
        plt.close(fig)
        print(f"wrote {out_dir / f'capacity-{name}.png'}")


if __name__ == "__main__":
    main()
