"""Command-line options of ``pdserve up --ray`` (standard library only, like
``worker.options``: the ``pdserve`` parser is built from them even without the server or
``ray`` extras)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

RAY_EXTRA = "pip install 'pdserve[server,ray]'"
_RAY_ONLY = ("ray_address", "device", "ray_gpu_resource", "ray_cpus_per_rank",
             "ray_router_cpus", "ray_max_restarts", "min_workers", "max_workers")


def add_ray_args(up: argparse.ArgumentParser) -> None:
    """``--ray`` and the options that only mean something with it."""
    ray = up.add_argument_group(
        "Ray", "pdserve up --ray: Redis and the router on this node, every worker a Ray "
        "actor with its tensor-parallel group in a placement group of its own "
        f"(needs {RAY_EXTRA})")
    ray.add_argument("--ray", action="store_true", help="run the cluster on Ray")
    ray.add_argument("--ray-address",
                     help="connect to this Ray cluster (auto: the one this node belongs to; "
                          "default: start a local Ray bound to --host, dashboard off)")
    ray.add_argument("--device", choices=("cpu", "cuda"),
                     help="the workers' device (default: cpu; cuda: each rank reserves a GPU)")
    ray.add_argument("--ray-gpu-resource", metavar="NAME",
                     help="the Ray resource each rank reserves one unit of (default: GPU with "
                          "--device cuda, none with cpu)")
    ray.add_argument("--ray-cpus-per-rank", type=float, metavar="N",
                     help="CPUs each rank reserves (default: 1)")
    ray.add_argument("--ray-router-cpus", type=float, metavar="N",
                     help="CPUs the router reserves on this node (default: 1; 0: none)")
    ray.add_argument("--ray-max-restarts", type=int, metavar="N",
                     help="how often Ray restarts a worker that died (default: 3; -1: always)")
    ray.add_argument("--max-workers", type=int, metavar="N",
                     help="let the planner grow the cluster to N workers: the driver adds a "
                          "worker actor, or drains one (its streams move), at each of the "
                          "planner's scale steps (with --planner, the planner gets it too)")
    ray.add_argument("--min-workers", type=int, metavar="N",
                     help="the fewest workers the planner may shrink the cluster to "
                          "(default: 2, or 1 with --local-prefill always/fallback)")


def ray_only_flags_given(args: argparse.Namespace) -> list[str]:
    """The options given that need ``--ray`` (as typed: ``--ray-address``, ...)."""
    return [f"--{name.replace('_', '-')}" for name in _RAY_ONLY if getattr(args, name) is not None]


def planner_scale_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The planner's share of ``--min-workers`` / ``--max-workers``: it decides the steps
    within the bounds the launcher applies them in. ``ValueError`` for a minimum below the
    planner's floor (a decode worker, and a prefill worker unless the routers prefill)."""
    floor = 2 if args.local_prefill == "never" else 1
    if args.min_workers is not None and args.min_workers < floor:
        raise ValueError(f"--min-workers {args.min_workers} is below the planner's floor "
                         f"{floor}: it keeps a decode worker"
                         + (" and, with --local-prefill never, a prefill worker"
                            if floor == 2 else ""))
    return tuple(word for flag, value in (("--min-workers", args.min_workers),
                                          ("--max-workers", args.max_workers))
                 if value is not None for word in (flag, str(value)))


def ray_missing() -> bool:
    return importlib.util.find_spec("ray") is None


def ray_spec_from_args(args: argparse.Namespace, cluster: Any) -> Any:
    """The ``deploy.ray.plan.RaySpec`` of ``pdserve up --ray ARGS`` around ``cluster`` (a
    ``ClusterSpec``); without ``--redis-url``, ``$PDSERVE_REDIS_URL`` names the Redis (it
    reaches the processes in their environment only). ``ValueError`` for values that do not
    go together."""
    import dataclasses

    from deploy.ray.plan import RaySpec

    redis_url = cluster.redis_url or os.environ.get("PDSERVE_REDIS_URL") or None
    given = {key: value for key, value in (
        ("address", args.ray_address), ("device", args.device),
        ("gpu_resource", args.ray_gpu_resource), ("cpus_per_rank", args.ray_cpus_per_rank),
        ("router_cpus", args.ray_router_cpus), ("max_restarts", args.ray_max_restarts),
        ("min_workers", args.min_workers), ("max_workers", args.max_workers))
        if value is not None}
    return RaySpec(cluster=dataclasses.replace(cluster, redis_url=redis_url), **given)
