"""The Ray calls of ``deploy.ray.launcher`` that are not about one actor: connecting (or
starting a local Ray), and what the launcher looks up or says about the Ray cluster.

Ray is imported only inside the functions that call it (the ``ray`` extra is optional).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from deploy.ray.plan import RaySpec, WorkerPlan
from deploy.spec import WILDCARDS, ClusterError, is_loopback

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported, Ray keeps 127.0.0.1 as the node address (otherwise it
replaces a loopback ``_node_ip_address`` by the machine's outward address)."""


def ray_init_kwargs(spec: RaySpec) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment to set before importing Ray, and ``ray.init``'s arguments."""
    common: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if spec.address is not None:
        return {}, {"address": spec.address, **common}
    host = spec.cluster.host
    env = {LOOPBACK_ENV: "0"} if is_loopback(host) else {}
    local: dict[str, Any] = {"include_dashboard": False, **common}
    if host not in WILDCARDS:
        local["_node_ip_address"] = "127.0.0.1" if host == "localhost" else host
    return env, local


def init_ray(spec: RaySpec) -> Any:
    """Connects to (or starts) the Ray of ``spec``, keeping this process's SIGTERM handler
    (``ray.init`` replaces it with ``sys.exit``; ``pdserve up`` needs its own, which stops
    the cluster). Returns the ``ray`` module; raises what ``ray.init`` raises."""
    env, kwargs = ray_init_kwargs(spec)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    import ray

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**kwargs)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return ray


def place_workers(plans: Sequence[WorkerPlan], name_of: Callable[[str], str], timeout_s: float,
                  poll_s: float, groups: list[Any]) -> None:
    """A ``STRICT_PACK`` placement group of one bundle per worker (appended to ``groups``
    as they are created, so that the caller removes them whatever happens), all placed
    within ``timeout_s``; else ``ClusterError`` naming what did not fit and what is free."""
    import ray
    from ray.util.placement_group import placement_group

    for plan in plans:
        groups.append(placement_group([plan.bundle], strategy="STRICT_PACK",
                                      name=name_of(plan.name)))
    refs = [group.ready() for group in groups[-len(plans):]] if plans else []
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
    if pending:
        names = [plan.name for plan, ref in zip(plans, refs, strict=True) if ref in pending]
        needs = "; ".join(f"{p.name} needs one node with {bundle_text(p.bundle)}"
                          for p in plans if p.name in names)
        raise ClusterError(f"no room for {', '.join(names)} within {timeout_s:g}s: {needs}; "
                           f"the Ray cluster has {bundle_text(free_resources())} free")


def bundle_text(bundle: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(bundle.items())
                     if not k.startswith("node:") and k not in ("memory", "object_store_memory"))


def free_resources() -> dict[str, float]:
    import ray

    return {k: float(v) for k, v in ray.available_resources().items()}


def node_ips() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


def bundle_node(group: Any) -> str | None:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group).get("bundles_to_node_id", {}).get(0)


def gcs_reachable(timeout_s: float = 2.0) -> bool:
    """Whether Ray's GCS still accepts connections (a Ray call would hang otherwise)."""
    import ray

    try:
        host, _, port = str(ray.get_runtime_context().gcs_address).rpartition(":")
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except Exception:  # noqa: BLE001 - not connected, no address, refused: all "gone"
        return False
    return True


def quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Best effort while stopping: a dead actor or a gone Ray must not stop the rest."""
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - anything Ray raises here means "already gone"
        pass
