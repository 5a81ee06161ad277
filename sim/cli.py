"""A serving benchmark on a simulated cluster: the workloads, arrivals, metrics and table
of ``bench.serve`` (``vllm bench serve``'s, under vLLM's key names), no model and no
accelerator. What runs is pdserve's own router and scheduler code on a virtual clock, the
forward passes replaced by a profile's step times.

    pdserve simulate --profile profile.json --prefill 2 --decode 2 \\
        --dataset-name sharegpt-like --num-prompts 1000 --request-rate 8 \\
        --goodput ttft:2000 tpot:100 --json sim.json

``--profile``: a ``sim.profile`` JSON (from a source checkout, ``python -m bench.profile``
measures one on this machine and ``--derive`` derives one from a GPU's datasheet figures).
``--prefill N --decode M`` workers behind ``--routers K`` at ``--prefill-tp`` /
``--decode-tp`` (the profile must have step models at those sizes); ``--local-prefill``,
``--prefill-routing``, ``--local-prefill-max-tokens``, ``--max-inflight``,
``--max-queued-tokens``, ``--max-num-seqs`` and ``--max-num-batched-tokens`` mean what the
router's and the workers' flags do (they build the same config dataclasses); ``--kill
decode-0@30`` kills a worker at 30 virtual seconds (its requests are retried or migrated,
as the router does). Prompts are drawn below ``--vocab-size`` (their ids only feed the
block hashes). A run that lasts says how far it is on stderr every ten seconds. Prints
the result table, then what the simulation did (virtual duration, events, wall time);
``--json PATH`` writes every figure under vLLM's key names (``median_ttft_ms``,
``p90_tpot_ms``, ``request_goodput``, …) plus ``simulation``, and with ``--save-detailed``
the per-request lists. The same profile, flags and seed give the
same figures.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import SchedulerConfig
from loadtest.workloads import WORKLOADS, Workload, WorkloadSpec
from router.config import LOCAL_PREFILL_MODES, PREFILL_ROUTING, AdmissionConfig, HandoffConfig
from sim.metrics import DEFAULT_PERCENTILES, arrival_times, parse_goodput, render, write_json

# The parser builders import only standard-library modules: `pdserve`'s parser is built
# where only the SDK is installed. The simulator itself (its block hashes need xxhash) is
# imported when a command runs.
if TYPE_CHECKING:
    from sim.cluster import SimSpec
    from sim.profile import Profile

HELP = "serve a workload on a simulated cluster (a step-time profile, no model)"
DEFAULT_VOCAB = 32000


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload, arrival and metric flags ``bench.serve`` and ``pdserve simulate``
    share."""
    p.add_argument("--dataset-name", choices=WORKLOADS, default="random")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for request_goodput, e.g. ttft:500 tpot:50 (e2el too)")
    p.add_argument("--metric-percentiles", default=",".join(f"{q:g}" for q in DEFAULT_PERCENTILES))


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace
                        ) -> argparse.Namespace:
    """``add_workload_args``' flags checked (``p.error`` naming what is wrong), with
    ``slo_ms``, ``percentiles`` and the ``spec`` (``WorkloadSpec``) added."""
    try:
        args.slo_ms = parse_goodput(args.goodput)
        args.percentiles = [float(q) for q in args.metric_percentiles.split(",") if q]
        args.spec = workload_spec_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    if args.num_prompts < 1:
        p.error("--num-prompts must be at least 1")
    if not args.request_rate > 0:  # inf: all at once
        p.error(f"--request-rate must be > 0 requests a second, got {args.request_rate:g}")
    if not args.burstiness > 0:
        p.error(f"--burstiness must be > 0 (1: Poisson arrivals), got {args.burstiness:g}")
    if not all(0 <= q <= 100 for q in args.percentiles):
        p.error(f"--metric-percentiles takes percentiles from 0 to 100, got "
                f"{args.metric_percentiles!r}")
    return args


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.dataset_name, input_len=args.input_len, output_len=args.output_len,
                        range_ratio=args.range_ratio, prefix_len=args.prefix_len,
                        suffix_len=args.suffix_len, num_prefixes=args.num_prefixes)


def add_simulation_args(p: argparse.ArgumentParser) -> None:
    """The simulated cluster's flags: the profile, the cluster's shape, the router's and the
    workers' flags, faults, the prompts' vocabulary and ``--json``."""
    p.add_argument("--profile", type=Path, required=True, help="a sim.profile JSON")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas (requests in turn; loads and KV index shared)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--local-prefill", choices=LOCAL_PREFILL_MODES, default=None,
                   help="default: never, or always without prefill workers")
    p.add_argument("--prefill-routing", choices=PREFILL_ROUTING, default="kv-aware")
    p.add_argument("--local-prefill-max-tokens", type=int,
                   default=HandoffConfig.local_prefill_max_tokens)
    p.add_argument("--max-inflight", type=int, default=AdmissionConfig.max_inflight)
    p.add_argument("--max-queued-tokens", type=int, default=AdmissionConfig.max_queued_tokens)
    # the workers' defaults: the engine's scheduler configuration
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    p.add_argument("--kill", action="append", default=[], metavar="WORKER@SECONDS",
                   help="a fault: the worker (prefill-0, decode-1, ...) dies then; repeatable")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--save-detailed", action="store_true",
                   help="--json also gets the per-request lists (input_lens, output_lens, "
                        "ttfts, tpots, e2els, itls, errors), as vLLM's flag does")


def check_simulation_args(p: argparse.ArgumentParser, args: argparse.Namespace
                          ) -> argparse.Namespace:
    """``add_simulation_args``' and ``add_workload_args``' flags checked (``p.error`` naming
    what is wrong), with ``kills``, ``local_prefill``'s default and the ``sim_spec``
    (``SimSpec``) added, besides what ``check_workload_args`` adds."""
    check_workload_args(p, args)
    try:
        Workload(args.spec, args.vocab_size)  # the vocabulary checked
    except ValueError as exc:
        p.error(f"--vocab-size: {exc}")
    try:
        args.kills = tuple((w, float(t)) for w, _, t in (k.partition("@") for k in args.kill))
    except ValueError:
        p.error(f"--kill takes WORKER@SECONDS, got {args.kill!r}")
    if args.local_prefill is None:
        args.local_prefill = "always" if args.prefill == 0 else "never"
    try:
        args.sim_spec = spec_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    """The simulated cluster the checked flags describe (``ValueError`` naming what is
    wrong)."""
    from sim.cluster import SimSpec

    return SimSpec(
        num_prefill=args.prefill, num_decode=args.decode, num_routers=args.routers,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
        handoff=HandoffConfig(local_prefill=args.local_prefill,
                              prefill_routing=args.prefill_routing,
                              local_prefill_max_tokens=args.local_prefill_max_tokens),
        admission=AdmissionConfig(max_inflight=args.max_inflight,
                                  max_queued_tokens=args.max_queued_tokens),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kills=args.kills)


def load_profile(args: argparse.Namespace) -> Profile:
    """``--profile``, with step models at ``--prefill-tp`` and ``--decode-tp``
    (``ProfileError`` naming the file and what is wrong)."""
    from sim.profile import ProfileError, load

    profile = load(args.profile)
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        if tp not in profile.steps:  # the profile's error, with the flag that asked
            raise ProfileError(f"{flag} {tp}: {profile.source} profile {args.profile} has "
                               f"no steps at TP {tp}; it has TP "
                               f"{', '.join(map(str, sorted(profile.steps)))}")
    return profile


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    """One simulated run of the workload on the cluster the flags describe (checked by
    ``check_simulation_args``): prints ``bench.serve``'s table and what the simulation did,
    writes ``--json``, returns the result. ``ProfileError`` when the profile cannot be used."""
    from sim.runs import run

    profile = load_profile(args)
    requests = Workload(args.spec, args.vocab_size, seed=args.seed).take(args.num_prompts)
    times = arrival_times(len(requests), args.request_rate, args.seed, args.burstiness)
    result: dict[str, Any] = {
        "backend": "simulated", "profile": str(args.profile),
        "profile_source": profile.source, "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "seed": args.seed, "workload": vars(args.spec),
        "goodput_slo_ms": args.slo_ms,
        "cluster": {"num_prefill": args.prefill, "num_decode": args.decode,
                    "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
                    "routers": args.routers,
                    "local_prefill": args.local_prefill,
                    "prefill_routing": args.prefill_routing},
        **run(profile, args.sim_spec, requests, times, args.slo_ms, args.percentiles,
              detailed=args.save_detailed, progress=print_progress)}
    print(render(result, title=f"Simulated Serving Result ({profile.source} profile)"))
    sim = result["simulation"]
    print(f"simulated {sim['virtual_s']:.1f} s of serving ({sim['events']} events) in "
          f"{sim['wall_s']:.2f} s")
    if args.json:
        write_json(args.json, result)
    return result


def print_progress(virtual_s: float, ended: int, total: int) -> None:
    """A long run's progress line, on stderr (``sim.cluster.Progress``)."""
    print(f"simulating: {ended:,} of {total:,} requests ended, {virtual_s:,.1f} s of serving "
          "simulated", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the command


def add_simulate_parser(sub: Any) -> None:
    """The ``simulate`` subcommand on ``sub`` (the ``pdserve`` parser's subparsers)."""
    p = sub.add_parser("simulate", help=HELP, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_simulation_args(p)
    add_workload_args(p)
    p.set_defaults(func=functools.partial(command, p))


def command(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``pdserve simulate`` on ``p``'s parsed ``args``: the exit code, 0, or 2 with one line
    on stderr when the profile cannot be used (``p.error`` for flags that are wrong)."""
    from sim.profile import ProfileError

    check_simulation_args(p, args)
    try:
        simulate(args)
    except ProfileError as exc:
        print(f"pdserve simulate: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``pdserve simulate ARGV`` without the rest of ``pdserve``'s parser."""
    p = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_simulation_args(p)
    add_workload_args(p)
    return command(p, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
