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

from deploy.ray.plan import RaySpec, local_ray_cpus
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
    # sized for the plan it is about to place: else on a small machine the router, placed
    # last, could wait for a CPU the workers took
    local: dict[str, Any] = {"include_dashboard": False,
                             "num_cpus": local_ray_cpus(spec, os.cpu_count() or 1), **common}
    if host not in WILDCARDS:
        local["_node_ip_address"] = "127.0.0.1" if host == "localhost" else host
    return env, local


def prepare_ray_env(spec: RaySpec) -> dict[str, Any]:
    """Set the environment ``spec``'s Ray needs (call before Ray is first imported: it
    reads it then); returns ``ray.init``'s arguments."""
    env, kwargs = ray_init_kwargs(spec)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return kwargs


def connect(spec: RaySpec, progress: Callable[[str], None]) -> bool:
    """Connects this process to ``spec``'s Ray (or starts a local one, bound to ``--host``,
    dashboard off); whether it started it (its owner shuts it down). ``ClusterError`` when
    it cannot."""
    prepare_ray_env(spec)  # before Ray's first import: it reads it then
    import ray

    address, owns = spec.address, False
    if ray.is_initialized():
        progress("ray: using this process's Ray connection")
    else:
        try:
            init_ray(spec)
        except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here
            what = "connect to" if address else "start"
            text = str(exc).strip().splitlines()
            raise ClusterError(f"cannot {what} Ray {address or ''}: "
                               f"{text[0] if text else type(exc).__name__}") from None
        owns = address is None
    node_ip = ray.util.get_node_ip_address()
    if owns:
        check_bound(spec.cluster.host, node_ip)
        progress(f"ray: started a local Ray on {node_ip} (dashboard off)")
    elif address is not None:
        alive = len([n for n in ray.nodes() if n["Alive"]])
        progress(f"ray: connected to {address} ({alive} {'node' if alive == 1 else 'nodes'})")
    return owns


def check_bound(host: str, node_ip: str) -> None:
    """``ClusterError`` unless the local Ray's node address ``node_ip`` is what ``--host``
    asked for."""
    if host in WILDCARDS or (is_loopback(host) and is_loopback(node_ip)) or host == node_ip:
        return
    raise ClusterError(f"the local Ray bound {node_ip}, not --host {host} (was Ray "
                       f"imported before {LOOPBACK_ENV}=0 was set?)")


def init_ray(spec: RaySpec) -> Any:
    """Connects to (or starts) the Ray of ``spec``, keeping this process's SIGTERM handler
    (``ray.init`` replaces it with ``sys.exit``; ``pdserve up`` needs its own, which stops
    the cluster). Returns the ``ray`` module; raises what ``ray.init`` raises."""
    kwargs = prepare_ray_env(spec)
    import ray

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**kwargs)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return ray


def place_workers(plans: Sequence[tuple[str, dict[str, float]]], name_of: Callable[[str], str],
                  timeout_s: float, poll_s: float, groups: list[Any],
                  stop: threading.Event | None = None) -> None:
    """A ``STRICT_PACK`` placement group of one bundle per (name, bundle) — each worker's,
    the router's — appended to ``groups`` as they are created (so that the caller removes
    them whatever happens), all placed within ``timeout_s``; else ``ClusterError`` naming
    what did not fit, what is free and the flags that change what is asked for (or, once
    ``stop`` is set, that the cluster is stopping)."""
    import ray
    from ray.util.placement_group import placement_group

    for name, bundle in plans:
        groups.append(placement_group([bundle], strategy="STRICT_PACK", name=name_of(name)))
    refs = [group.ready() for group in groups[-len(plans):]] if plans else []
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending and time.monotonic() < deadline and not (stop and stop.is_set()):
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
    if pending and stop is not None and stop.is_set():
        raise ClusterError("the cluster is stopping")
    if pending:
        names = [name for (name, _), ref in zip(plans, refs, strict=True) if ref in pending]
        needs = "; ".join(f"{name} needs {_where(bundle)} with {bundle_text(bundle)}"
                          for name, bundle in plans if name in names)
        raise ClusterError(f"no room for {', '.join(names)} within {timeout_s:g}s: {needs}; "
                           f"the Ray cluster has {bundle_text(free_resources())} free "
                           "(--ray-cpus-per-rank and --ray-router-cpus set the CPUs asked for; "
                           "a local Ray is sized for the plan)")


def _where(bundle: dict[str, float]) -> str:
    node = next((k.removeprefix("node:") for k in bundle if k.startswith("node:")), None)
    return "one node" if node is None else f"this node ({node})"


def placed_text(names: Sequence[str], groups: Sequence[Any]) -> str:
    """The progress line of placed groups: ``placed prefill-0 on 10.0.0.7, ...``."""
    nodes = node_ips()
    return "placed " + ", ".join(f"{name} on {nodes.get(bundle_node(group) or '', '?')}"
                                 for name, group in zip(names, groups, strict=True))


def pinned_here() -> Any:
    """A scheduling strategy: on this process's node (strictly)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def this_node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


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
