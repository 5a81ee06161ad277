"""``pdserve set-role WORKER ROLE``: switch a running worker's role live (the internal
``SetRole``, ``cluster.worker_control``). WORKER is its gRPC address, or its id with
``--redis-url`` (looked up in the registry). Its parser is standard library only; the
command imports the cluster's modules when it runs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_set_role_parser(sub: Any) -> None:
    """The ``set-role`` subcommand on ``sub`` (the ``pdserve`` parser's subparsers)."""
    from cluster.internal_tls import add_internal_tls_args
    from cluster.token import add_token_arg
    from worker.options import REDIS_URL_ENV

    switch = sub.add_parser("set-role", help="switch a running worker's role live "
                            "(a `pdserve worker`, `prefill` or `decode`)",
                            epilog="exit codes: 0 switched, 2 refused (the worker says why), "
                                   "1 could not ask")
    switch.add_argument("worker", help="the worker's gRPC address (HOST:PORT), or its id "
                        "with --redis-url")
    switch.add_argument("role", choices=("prefill", "decode"))
    switch.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV),
                        help=f"the cluster's Redis, to find a worker by id (default: "
                             f"${REDIS_URL_ENV})")
    switch.add_argument("--cluster", default="default", help="Redis key namespace")
    switch.add_argument("--move", action="store_true",
                        help="to prefill: its decoding requests move with their KV to the "
                             "other decode workers at once (default: they finish there)")
    add_token_arg(switch)
    add_internal_tls_args(switch)
    switch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from cluster.internal_tls import internal_tls
    from cluster.registry import Registry, RegistryError
    from cluster.token import load_cluster_token
    from cluster.worker_control import RoleSwitchError, set_role

    address = args.worker
    try:
        token, tls = load_cluster_token(args.cluster_token_file), internal_tls(args)
        if ":" not in address:  # a worker id: its address is in the registry
            if not args.redis_url:
                raise ValueError(f"{address!r} is no HOST:PORT; give --redis-url to find a "
                                 "worker by id")
            with Registry(args.redis_url, cluster=args.cluster) as registry:
                found = {w.worker_id: w for w in registry.list_workers()}
            if address not in found:
                raise ValueError(f"no worker {address!r} in cluster {args.cluster!r} "
                                 f"(registered: {', '.join(sorted(found)) or 'none'})")
            address = found[address].grpc_address
    except (ValueError, RegistryError) as exc:
        print(f"pdserve set-role: {exc}", file=sys.stderr)
        return 1
    try:
        switch = asyncio.run(set_role(address, args.role, token=token, tls=tls,
                                      move_decoding=args.move))
    except RoleSwitchError as exc:
        print(f"pdserve set-role: {args.worker} {'refused' if exc.refused else 'failed'}: "
              f"{exc}", file=sys.stderr)
        return 2 if exc.refused else 1
    print(f"{args.worker}: {switch.previous_role} -> {switch.role}")
    return 0
