"""``bench.serve`` on a simulated cluster: the same workloads, arrivals and table, no model.

    python -m bench.simulate --profile profile.json --prefill 2 --decode 2 \\
        --dataset-name sharegpt-like --num-prompts 1000 --request-rate 8 \\
        --goodput ttft:2000 tpot:100 --json sim.json

``--profile``: a ``sim.profile`` JSON (``python -m bench.profile`` measures one).
``--prefill N --decode M`` workers behind ``--routers K`` at ``--prefill-tp`` / ``--decode-tp`` (the profile must
have step models at those sizes); ``--local-prefill``, ``--prefill-routing``,
``--local-prefill-max-tokens``, ``--max-inflight``, ``--max-queued-tokens``,
``--max-num-seqs`` and ``--max-num-batched-tokens`` mean what the router's and the
workers' flags do (they build the same config dataclasses); ``--kill decode-0@30`` kills
a worker at 30 virtual seconds (its requests are retried or migrated, as the router does). Prompts are drawn below
``--vocab-size`` (their ids only feed the block hashes). Prints ``bench.serve``'s table,
then what the simulation did (virtual duration, events, wall time); ``--json PATH``
writes ``bench.serve``'s keys (``median_ttft_ms``, ``p90_tpot_ms``, ``request_goodput``,
…) plus ``simulation`` and the per-request lists. ``--validate`` runs real clusters and
the simulator on the same requests and reports the error of each metric
(``bench.sim_validation``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import write_json
from bench.serve import add_workload_args, check_workload_args
from bench.serving import arrival_times, render
from bench.sim_runs import run
from loadtest.workloads import Workload
from router.config import LOCAL_PREFILL_MODES, PREFILL_ROUTING, AdmissionConfig, HandoffConfig
from sim.cluster import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, SimSpec
from sim.profile import ProfileError, load

DEFAULT_VOCAB = 32000


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas (requests in turn; loads and KV index shared)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--local-prefill", choices=LOCAL_PREFILL_MODES, default=None,
                   help="default: never, or always without prefill workers")
    p.add_argument("--prefill-routing", choices=PREFILL_ROUTING, default="kv-aware")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0)
    p.add_argument("--max-inflight", type=int, default=AdmissionConfig.max_inflight)
    p.add_argument("--max-queued-tokens", type=int, default=AdmissionConfig.max_queued_tokens)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    p.add_argument("--kill", action="append", default=[], metavar="WORKER@SECONDS",
                   help="a fault: the worker (prefill-0, decode-1, ...) dies then; repeatable")
    add_workload_args(p)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--validate", action="store_true",
                   help="compare with real clusters instead (bench.sim_validation)")
    p.add_argument("--validate-rates", default="1,2,3", help="request rates to validate at")
    p.add_argument("--model", type=Path, help="--validate: the profile's checkpoint "
                                               "(default: bench55m; --quick: the tiny model)")
    p.add_argument("--quick", action="store_true", help="--validate: one small point")
    args = check_workload_args(p, p.parse_args(argv))
    try:
        args.kills = tuple((w, float(t)) for w, _, t in (k.partition("@") for k in args.kill))
    except ValueError:
        p.error(f"--kill takes WORKER@SECONDS, got {args.kill!r}")
    try:
        args.validate_rates = [float(r) for r in args.validate_rates.split(",") if r]
    except ValueError:
        p.error(f"--validate-rates takes rates separated by commas, got {args.validate_rates!r}")
    if args.local_prefill is None:
        args.local_prefill = "always" if args.prefill == 0 else "never"
    try:
        args.sim_spec = spec_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    return SimSpec(
        num_prefill=args.prefill, num_decode=args.decode, num_routers=args.routers,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        handoff=HandoffConfig(local_prefill=args.local_prefill,
                              prefill_routing=args.prefill_routing,
                              local_prefill_max_tokens=args.local_prefill_max_tokens),
        admission=AdmissionConfig(max_inflight=args.max_inflight,
                                  max_queued_tokens=args.max_queued_tokens),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kills=args.kills)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        profile = load(args.profile)
        for tp in {args.prefill_tp, args.decode_tp}:
            profile.step(tp)
    except ProfileError as exc:
        raise SystemExit(f"bench.simulate: {exc}") from None
    if args.validate:
        from bench.sim_validation import validate

        report = validate(profile, args.model, quick=args.quick, rates=args.validate_rates,
                          num_prompts=args.num_prompts, seed=args.seed)
        print("MAPE below saturation: " + ", ".join(
            f"{k} {v:.1%}" for k, v in report["mape"].items() if v is not None))
        print(f"goal ({report['goal']}): {'met' if report['goal_met_below_saturation'] else 'not met'}")
        if args.json:
            write_json(args.json, report)
        return report
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
        **run(profile, args.sim_spec, requests, times, args.slo_ms, args.percentiles)}
    print(render(result, title=f"Simulated Serving Result ({profile.source} profile)"))
    sim = result["simulation"]
    print(f"simulated {sim['virtual_s']:.1f} s of serving ({sim['events']} events) in "
          f"{sim['wall_s']:.2f} s")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
