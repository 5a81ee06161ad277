"""``pdserve up --ray``: the cluster of ``pdserve up`` run by Ray (``launch``, ``RayCluster``,
``serve``). Needs the ``ray`` extra (``pip install 'pdserve[server,ray]'``); imports Ray only
when a cluster starts.

Where things run. This process is the Ray driver; Redis (unless a URL is given) and the
router run on its node (under a RayJob: the head), each as an actor pinned there; every
prefill and decode worker is an actor in a placement group of its own, placed wherever
Ray finds room (``pdserve.ray_plan``: one STRICT_PACK bundle with the TP group's CPUs and
GPUs). Each actor runs the pdserve command as its child (``pdserve.ray_actors``); workers
bind and advertise their node's IP. Logs go to ``LOG_DIR/NAME.log`` on each actor's node.

Order of start: router port check → Ray (connect to ``address``, or start a local Ray bound
to ``--host``, dashboard off) → Redis → every placement group (all placed within
``placement_timeout_s``, or ``ClusterError`` naming what did not fit) → every worker actor,
each ready once its child wrote its ready file (it has registered in Redis by then) →
router. Stop (idempotent, also after a failed start): router → workers (SIGTERM to each
child, SIGKILL after ``stop_grace_s``) → Redis; then every actor is killed, every placement
group removed, and a Ray this process started is shut down.

Failures. A worker whose child dies after it was ready is restarted by Ray in the same
placement group (up to ``max_restarts``) and registers again; the router routes to the
others meanwhile. ``wait()`` reports that through ``progress`` and raises ``ChildExited``
when a worker cannot come back (restarts spent, or its new child failed before it was
ready), or when the router or Redis dies (neither is restarted). Actors and placement
groups are the driver's (not detached): Ray removes them when this process dies, however.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pdserve.local_cluster import ChildExited, ClusterError, _redacted, check_port_free
from pdserve.local_cluster import serve as serve_cluster
from pdserve.ray_actors import RedisActor, SupervisedChild
from pdserve.ray_members import Member, first_line, poll, quote
from pdserve.ray_plan import (
    NAMESPACE,
    ChildStatus,
    RayClusterConfig,
    WorkerPlan,
    actor_resources,
    is_loopback,
    plan_workers,
    router_spec,
    worker_spec,
)
from router.auth import API_KEY_ENV
from worker.options import WILDCARDS

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported, Ray keeps 127.0.0.1 as the node address (otherwise it
replaces a loopback ``_node_ip_address`` by the machine's outward address)."""
_POLL_S = 0.25
_CONCURRENCY = 4  # an actor answers status() while stop() waits for its child


def ray_init_kwargs(config: RayClusterConfig) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment to set before importing Ray, and ``ray.init``'s arguments."""
    common: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if config.address is not None:
        return {}, {"address": config.address, **common}
    host = config.layout.host
    env = {LOOPBACK_ENV: "0"} if is_loopback(host) else {}
    local: dict[str, Any] = {"include_dashboard": False, **common}
    if host not in WILDCARDS:
        local["_node_ip_address"] = "127.0.0.1" if host == "localhost" else host
    return env, local


class RayCluster:
    """Starts and stops ``config`` on Ray (a context manager); ``progress`` gets one line per
    step. ``start()`` returns once every process is ready (``ClusterError`` otherwise, after
    stopping what it started); ``wait()`` watches the actors; ``stop()`` removes every actor
    and placement group it created (idempotent)."""

    def __init__(self, config: RayClusterConfig,
                 progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._progress = progress or (lambda _line: None)
        self.log_dir: Path | None = None
        self.redis_url: str | None = config.layout.redis_url
        self.workers: list[Member] = []
        self.router: Member | None = None
        self._redis: Member | None = None
        self._placement_groups: list[Any] = []
        self._owns_ray = False
        self._connected = False

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def router_address(self) -> str:
        """``HOST:PORT`` of the public API (the node's IP when the router binds a wildcard)."""
        if self.router is None or self.router.ready is None or self.router.status is None:
            raise RuntimeError("the router is not running")
        return self._reachable(str(self.router.ready["grpc_address"]))

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the OpenAI-compatible HTTP API (the node's IP when the
        router binds a wildcard)."""
        if self.router is None or self.router.ready is None or self.router.status is None:
            raise RuntimeError("the router is not running")
        address = self.router.ready.get("http_address")
        if address is None:
            raise RuntimeError("the router serves no HTTP API (http_port is None)")
        return f"http://{self._reachable(str(address))}"

    def _reachable(self, address: str) -> str:
        assert self.router is not None and self.router.status is not None
        host, _, port = address.rpartition(":")
        return f"{self.router.status.node_ip if host in WILDCARDS else host}:{port}"

    @property
    def placement_groups(self) -> list[Any]:
        """The placement groups it created (one per worker, in ``workers`` order)."""
        return list(self._placement_groups)

    def statuses(self) -> dict[str, ChildStatus]:
        """Name → the latest status of every actor started and not yet stopped."""
        return {m.name: m.status for m in self._members() if m.status is not None}

    def start(self) -> RayCluster:
        layout = self.config.layout
        try:
            if layout.start_router:
                check_port_free(layout.host, layout.port)
            self._prepare()
            self._connect()
            self._start_redis()
            plans = plan_workers(self.config)
            self._place(plans)
            self._start_workers(plans)
            if layout.start_router:
                self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def check(self) -> None:
        """Follows every actor once: reports restarts; ``ChildExited`` when one is gone."""
        members = self._members()
        for member, status in zip(members, poll(members), strict=True):
            member.follow(status, self._progress)

    def wait(self, timeout_s: float | None = None) -> None:
        """Returns after ``timeout_s`` (never with None) unless a process is gone for good:
        then raises ``ChildExited``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            self.check()
            time.sleep(_POLL_S)
        self.check()

    def stop(self) -> None:
        """Router, workers, Redis (each tier: SIGTERM, SIGKILL after the grace period); then
        every actor killed, every placement group removed, our own Ray shut down."""
        tiers = [[self.router] if self.router else [], self.workers,
                 [self._redis] if self._redis else []]
        groups, self._placement_groups = self._placement_groups, []
        self.router, self.workers, self._redis = None, [], None
        started = any(tiers) or bool(groups)
        if started:
            self._progress("stopping ...")
        if self._connected and not _gcs_reachable():
            # Ray went first (e.g. a SIGTERM to the whole process group): its actors, and
            # with them their children, are gone; calls into it would only hang
            self._progress("Ray is gone, and every actor with it")
        elif self._connected:
            from ray.util.placement_group import remove_placement_group

            for tier in tiers:
                self._stop_tier(tier)
            for group in groups:
                _quietly(remove_placement_group, group)
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False
            self._progress("local Ray stopped")
        self._connected = False
        if started:
            self._progress("all processes stopped")

    # ------------------------------------------------------------------ start steps

    def _members(self) -> list[Member]:
        return [*([self._redis] if self._redis else []), *self.workers,
                *([self.router] if self.router else [])]

    def _prepare(self) -> None:
        layout = self.config.layout
        self.log_dir = (Path(layout.log_dir) if layout.log_dir is not None
                        else Path(tempfile.mkdtemp(prefix="pdserve-up-")))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._progress(f"logs in {self.log_dir} (on each actor's node)")
        if layout.model_dir is None:
            self._progress("model: the built-in tiny model (each node builds it on first use)")
        elif not (Path(layout.model_dir) / "config.json").is_file():
            raise ClusterError(f"{layout.model_dir} is not a model directory (no config.json)")
        else:
            self._progress(f"model: {layout.model_dir} (the same path on every node)")

    def _connect(self) -> None:
        env, kwargs = ray_init_kwargs(self.config)
        for key, value in env.items():
            os.environ.setdefault(key, value)
        import ray

        if ray.is_initialized():
            self._progress("ray: using this process's Ray connection")
        else:
            what = "connect to" if self.config.address else "start"
            try:
                _init_keeping_sigterm(ray, kwargs)
            except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here
                raise ClusterError(f"cannot {what} Ray {self.config.address or ''}: "
                                   f"{first_line(exc)}") from None
            self._owns_ray = self.config.address is None
        self._connected = True
        node_ip = ray.util.get_node_ip_address()
        if self._owns_ray:
            self._check_bound(node_ip)
            self._progress(f"ray: started a local Ray on {node_ip} (dashboard off)")
        elif self.config.address is not None:
            alive = len([n for n in ray.nodes() if n["Alive"]])
            self._progress(f"ray: connected to {self.config.address} "
                           f"({alive} {'node' if alive == 1 else 'nodes'})")

    def _check_bound(self, node_ip: str) -> None:
        host = self.config.layout.host
        if host in WILDCARDS or (is_loopback(host) and is_loopback(node_ip)) or host == node_ip:
            return
        raise ClusterError(f"the local Ray bound {node_ip}, not --host {host} (was Ray "
                           f"imported before {LOOPBACK_ENV}=0 was set?)")

    def _start_redis(self) -> None:
        if self.redis_url is not None:
            self._progress(f"using Redis at {_redacted(self.redis_url)}")
            return
        self._progress("starting redis-server ...")
        args = (str(self.log_dir), self.config.layout.stop_grace_s)
        actor = self._actor(RedisActor, "redis", args, num_cpus=0, max_restarts=0,
                            scheduling_strategy=self._here())
        self._redis = Member("redis", actor, restartable=False)
        self.redis_url = str(self._get(actor.url.remote(), "redis"))
        self._progress(f"redis ready at {_redacted(self.redis_url)}")

    def _place(self, plans: Sequence[WorkerPlan]) -> None:
        from ray.util.placement_group import placement_group

        self._progress("placing " + ", ".join(f"{p.name} ({_bundle_text(p.bundle)})"
                                              for p in plans) + " ...")
        for plan in plans:
            self._placement_groups.append(placement_group(
                [plan.bundle], strategy="STRICT_PACK", name=self._name(plan.name)))
        self._wait_placed(plans)
        nodes = _node_ips()
        self._progress("placed " + ", ".join(
            f"{plan.name} on {nodes.get(_bundle_node(group) or '', '?')}"
            for plan, group in zip(plans, self._placement_groups, strict=True)))

    def _wait_placed(self, plans: Sequence[WorkerPlan]) -> None:
        import ray

        refs = [group.ready() for group in self._placement_groups]
        deadline = time.monotonic() + self.config.placement_timeout_s
        pending = list(refs)
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
        if pending:
            names = [plan.name for plan, ref in zip(plans, refs, strict=True) if ref in pending]
            needs = "; ".join(f"{p.name} needs one node with {_bundle_text(p.bundle)}"
                              for p in plans if p.name in names)
            raise ClusterError(f"no room for {', '.join(names)} within "
                               f"{self.config.placement_timeout_s:g}s: {needs}; the Ray "
                               f"cluster has {_bundle_text(_free_resources())} free")

    def _start_workers(self, plans: Sequence[WorkerPlan]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.redis_url is not None
        self._progress("starting " + ", ".join(f"{p.name} (TP {p.tp})" for p in plans) + " ...")
        for plan, group in zip(plans, self._placement_groups, strict=True):
            spec = worker_spec(self.config, plan, log_dir=str(self.log_dir),
                               redis_url=self.redis_url)
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
            actor = self._actor(SupervisedChild, plan.name, (spec,),
                                max_restarts=self.config.max_restarts,
                                scheduling_strategy=strategy, **actor_resources(plan.bundle))
            self.workers.append(Member(plan.name, actor, restartable=True))
        self._wait_ready(self.workers)

    def _start_router(self) -> None:
        assert self.redis_url is not None
        layout = self.config.layout
        self._progress(f"starting router on {layout.host}:{layout.port} ...")
        spec = router_spec(self.config, log_dir=str(self.log_dir),
                                      redis_url=self.redis_url,
                                      api_key=os.environ.get(API_KEY_ENV) or None)
        actor = self._actor(SupervisedChild, "router", (spec,), num_cpus=self.config.router_cpus,
                            max_restarts=0, scheduling_strategy=self._here())
        self.router = Member("router", actor, restartable=False)
        self._wait_ready([self.router])

    def _wait_ready(self, members: Sequence[Member]) -> None:
        deadline = time.monotonic() + self.config.layout.start_timeout_s
        pending = list(members)
        while pending:
            for member, status in zip(list(pending), poll(pending), strict=True):
                if status is not None and status.exit is not None:
                    raise ChildExited(member.name, f"{member.name} exited before it was "
                                                   f"ready ({status.exit}); {quote(status)}")
                if status is not None and status.ready is not None:
                    member.ready = status.ready
                    pending.remove(member)
                    self._progress(member.describe_ready())
            if pending and time.monotonic() > deadline:
                names = ", ".join(m.name for m in pending)
                raise ClusterError(f"not ready within {self.config.layout.start_timeout_s:.0f}s:"
                                   f" {names}; {quote(pending[0].status)}")
            if pending:
                time.sleep(_POLL_S)

    def _stop_tier(self, members: Sequence[Member]) -> None:
        if not members:
            return
        import ray

        grace = self.config.layout.stop_grace_s
        refs = [m.actor.stop.remote(grace) for m in members]
        _quietly(ray.wait, refs, num_returns=len(refs), timeout=grace + 10.0)
        for member in members:
            _quietly(ray.kill, member.actor, no_restart=True)

    # ------------------------------------------------------------------ Ray helpers

    def _name(self, name: str) -> str:
        return f"pdserve-{self.config.layout.cluster}-{name}"

    def _actor(self, cls: type, name: str, args: tuple[Any, ...], **options: Any) -> Any:
        """A new named actor of ``cls(*args)`` (its handle); ``ClusterError`` when the name
        is taken."""
        import ray

        remote: Any = ray.remote(cls).options(name=self._name(name), namespace=NAMESPACE,
                                              max_task_retries=0, max_concurrency=_CONCURRENCY,
                                              **options)
        try:
            return remote.remote(*args)
        except ValueError as exc:  # the name is taken
            raise ClusterError(f"{name}: {first_line(exc)} (is another pdserve up --ray "
                               f"with --cluster {self.config.layout.cluster} running on this "
                               "Ray?)") from None

    @staticmethod
    def _here() -> Any:
        """Pinned to this process's node (strictly)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)

    def _get(self, ref: Any, name: str) -> Any:
        """``ray.get`` in short steps (Ctrl-C stays responsive); a failed actor → ClusterError."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + self.config.layout.start_timeout_s
        while True:
            try:
                return ray.get(ref, timeout=_POLL_S)
            except GetTimeoutError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"{name} did not start within "
                                       f"{self.config.layout.start_timeout_s:.0f}s") from None
            except RayActorError as exc:
                raise ClusterError(f"{name} could not start: {first_line(exc)}") from None


def _init_keeping_sigterm(ray: Any, kwargs: dict[str, Any]) -> None:
    """``ray.init`` replaces the SIGTERM handler (with ``sys.exit``); ``pdserve up`` needs
    its own, which stops the cluster."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**kwargs)
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def launch(config: RayClusterConfig, progress: Callable[[str], None] | None = None
           ) -> RayCluster:
    """Starts ``config`` on Ray and returns the running cluster: ``router_address``,
    ``wait()``, ``stop()`` (the caller must call it, or use the cluster as a context
    manager). ``ClusterError`` when it cannot start (after stopping what it started)."""
    return RayCluster(config, progress).start()


def serve(config: RayClusterConfig, *, on_ready: Callable[[Any], int | None] | None = None,
          progress: Callable[[str], None] | None = None) -> int:
    """``pdserve up --ray``: as ``pdserve.local_cluster.serve`` (start, ``on_ready``, serve
    until SIGINT/SIGTERM, exit codes), with the processes run by Ray."""
    return serve_cluster(config.layout, on_ready=on_ready, progress=progress,
                         make_cluster=lambda say: RayCluster(config, progress=say))


# ------------------------------------------------------------------ text and lookups

def _bundle_text(bundle: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(bundle.items())
                     if not k.startswith("node:") and k not in ("memory", "object_store_memory"))


def _free_resources() -> dict[str, float]:
    import ray

    return {k: float(v) for k, v in ray.available_resources().items()}


def _node_ips() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


def _bundle_node(group: Any) -> str | None:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group).get("bundles_to_node_id", {}).get(0)


def _gcs_reachable(timeout_s: float = 2.0) -> bool:
    """Whether Ray's GCS still accepts connections (a Ray call would hang otherwise)."""
    import ray

    try:
        host, _, port = str(ray.get_runtime_context().gcs_address).rpartition(":")
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except Exception:  # noqa: BLE001 - not connected, no address, refused: all "gone"
        return False
    return True


def _quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Best effort while stopping: a dead actor or a gone Ray must not stop the rest."""
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - anything Ray raises here means "already gone"
        pass
