"""Command-line options of ``pdserve planner`` (standard library only: the ``pdserve``
parser is built from them even where the server extra is not installed)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from cluster.internal_tls import add_internal_tls_args
from cluster.token import add_token_arg

REDIS_URL_ENV = "PDSERVE_REDIS_URL"


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV),
                        help=f"the cluster's Redis (default: ${REDIS_URL_ENV})")
    parser.add_argument("--cluster", default="default", help="Redis key namespace")
    parser.add_argument("--profile", required=True,
                        help="the workers' step-time profile (python -m bench.profile --json "
                             "PATH, or --derive for a GPU): the capacity model's costs")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="the workers' TP size (the profile's step model of that size)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="the workers' --max-num-batched-tokens")
    parser.add_argument("--ttft-slo-ms", type=float, required=True)
    parser.add_argument("--tpot-slo-ms", type=float, required=True)
    parser.add_argument("--interval", type=float, default=5.0,
                        help="seconds between decisions")
    parser.add_argument("--window", type=float, default=20.0,
                        help="seconds of metrics each decision looks at")
    parser.add_argument("--dwell", type=float, default=30.0,
                        help="after a role change, none for this many seconds")
    parser.add_argument("--min-gain", type=float, default=0.05,
                        help="a split must be predicted this much better (0..1) to move")
    parser.add_argument("--min-prefill", type=int, default=0,
                        help="prefill workers to keep (0: the router's --local-prefill "
                             "fallback prefills on decode workers)")
    parser.add_argument("--min-decode", type=int, default=1, help="decode workers to keep")
    parser.add_argument("--max-prefill", type=int,
                        help="the most prefill workers it may have (default: no cap); a split "
                             "above it is switched back within it")
    parser.add_argument("--max-decode", type=int,
                        help="the most decode workers (default: no cap); with --max-prefill, "
                             "the cluster grows to their sum at most")
    parser.add_argument("--min-workers", type=int,
                        help="the fewest workers the cluster may shrink to (default: "
                             "--min-prefill + --min-decode); with --max-workers")
    parser.add_argument("--max-workers", type=int,
                        help="let the planner size the cluster up to this many workers: it "
                             "writes the scale target that pdserve up --ray acts on (default: "
                             "it only switches roles)")
    parser.add_argument("--lock-ttl", type=float, default=10.0,
                        help="the leader's lock lapses this long after its last renewal: a "
                             "waiting planner takes over then")
    parser.add_argument("--planner-id", help="default: planner-<random>")
    parser.add_argument("--host", default="127.0.0.1", help="what the metrics endpoint binds")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="/metrics port (0: any free port)")
    parser.add_argument("--ready-file", help="write the planner's id and metrics address "
                                             "here as JSON once it runs")
    add_token_arg(parser)
    add_internal_tls_args(parser)


def add_up_planner_args(up: argparse.ArgumentParser) -> None:
    """``pdserve up``'s planner options: ``--planner PROFILE`` and what it passes on."""
    group = up.add_argument_group("planner", "pdserve up --planner PROFILE: one planner "
                                  "process beside the cluster (pdserve planner)")
    group.add_argument("--planner", metavar="PROFILE",
                       help="also run the planner with this step-time profile: it switches "
                            "roles, and sizes a --ray --max-workers cluster, for the SLOs below")
    group.add_argument("--ttft-slo-ms", type=float, default=1000.0,
                       help="the planner's TTFT SLO (default 1000)")
    group.add_argument("--tpot-slo-ms", type=float, default=100.0,
                       help="the planner's TPOT SLO (default 100)")
    for role in ("prefill", "decode"):
        group.add_argument(f"--max-{role}", type=int, metavar="N",
                           help=f"the planner's cap on {role} workers (default: none)")


def up_planner_args(args: argparse.Namespace, scale_args: Callable[[], tuple[str, ...]]
                    ) -> tuple[str, ...] | None:
    """The ``pdserve planner`` options of ``pdserve up ARGS`` (None: no planner), with the
    launcher's ``scale_args()`` (``--min-workers`` / ``--max-workers``, asked only when a
    planner runs). ``ValueError`` for a planner option given without ``--planner``."""
    caps = tuple(word for flag, value in (("--max-prefill", args.max_prefill),
                                          ("--max-decode", args.max_decode))
                 if value is not None for word in (flag, str(value)))
    if args.planner is None:
        if caps:
            raise ValueError(f"{caps[0]} is the planner's: it needs --planner PROFILE")
        return None
    return ("--profile", os.path.abspath(args.planner), *scale_args(), *caps,
            "--ttft-slo-ms", str(args.ttft_slo_ms), "--tpot-slo-ms", str(args.tpot_slo_ms))
