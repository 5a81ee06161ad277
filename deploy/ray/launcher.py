"""``pdserve up --ray``: the cluster of ``pdserve up`` run by Ray (``launch``, ``RayLauncher``,
``serve``). Needs the ``ray`` extra (``pip install 'pdserve[server,ray]'``); imports Ray only
when a cluster starts.

Where things run. This process is the Ray driver; Redis (unless a URL is given) and the
router run on its node (under a RayJob: the head), each as an actor pinned there; every
prefill and decode worker is an actor in a placement group of its own, placed wherever
Ray finds room (``deploy.ray.plan``: one STRICT_PACK bundle with the TP group's CPUs and
GPUs). Each actor runs the pdserve command as its child (``deploy.ray.actors``); workers
bind and advertise their node's IP. Logs go to ``LOG_DIR/NAME.log`` on each actor's node.

Order of start (the launcher skeleton's, ``deploy.launcher``): router port check → log
directory, model, Ray (connect to ``address``, or start a local Ray bound to ``--host``,
dashboard off) → Redis → every placement group (all placed within
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

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deploy.launcher import Launcher
from deploy.launcher import serve as serve_launcher
from deploy.ray.actors import RedisActor, SupervisedChild
from deploy.ray.connect import (
    bundle_text,
    check_bound,
    gcs_reachable,
    init_ray,
    pinned_here,
    place_workers,
    placed_text,
    prepare_ray_env,
    quietly,
    this_node_ip,
)
from deploy.ray.members import Member, first_line, poll, quote
from deploy.ray.plan import (
    NAMESPACE,
    ChildStatus,
    RaySpec,
    WorkerPlan,
    actor_resources,
    plan_workers,
    router_bundle,
    router_spec,
    worker_spec,
)
from deploy.spec import API_KEY_ENV, WILDCARDS, ChildExited, ClusterError, redacted

_CONCURRENCY = 4  # an actor answers status() while stop() waits for its child


class RayLauncher(Launcher):
    """Starts and stops ``ray_spec`` on Ray (a context manager; see the module docstring).
    ``stop()`` removes every actor and placement group it created (idempotent)."""

    poll_s = 0.25

    def __init__(self, ray_spec: RaySpec, progress: Callable[[str], None] | None = None) -> None:
        super().__init__(ray_spec.cluster, progress)
        self.ray_spec = ray_spec
        self.workers: list[Member] = []
        self.router: Member | None = None
        self._redis: Member | None = None
        self._placement_groups: list[Any] = []
        self._router_group: Any = None  # placed with the workers' groups, on this node
        self._router_bundle: dict[str, float] = {}
        self._owns_ray = False
        self._connected = False

    def __enter__(self) -> RayLauncher:
        return self.start()

    def start(self) -> RayLauncher:
        super().start()
        return self

    @property
    def started(self) -> bool:
        return bool(self._members()) or bool(self._placement_groups) or self._connected

    @property
    def placement_groups(self) -> list[Any]:
        """The workers' placement groups (one per worker, in ``workers`` order)."""
        return [g for g in self._placement_groups if g is not self._router_group]

    def statuses(self) -> dict[str, ChildStatus]:
        """Name → the latest status of every actor started and not yet stopped."""
        return {m.name: m.status for m in self._members() if m.status is not None}

    def check(self) -> None:
        """Follows every actor once: reports restarts; ``ChildExited`` when one is gone."""
        members = self._members()
        for member, status in zip(members, poll(members), strict=True):
            member.follow(status, self.progress)

    def _router_ready(self) -> dict[str, Any]:
        if self.router is None or self.router.ready is None or self.router.status is None:
            raise RuntimeError("the router is not running")
        return self.router.ready

    def _reachable(self, address: str) -> str:
        """The node's IP when the router binds a wildcard."""
        assert self.router is not None and self.router.status is not None
        host, _, port = address.rpartition(":")
        return f"{self.router.status.node_ip if host in WILDCARDS else host}:{port}"

    def _stop_processes(self) -> None:
        tiers = [[self.router] if self.router else [], self.workers,
                 [self._redis] if self._redis else []]
        groups, self._placement_groups, self._router_group = self._placement_groups, [], None
        self.router, self.workers, self._redis = None, [], None
        if self._connected and not gcs_reachable():
            # Ray went first (e.g. a SIGTERM to the whole process group): its actors, and
            # with them their children, are gone; calls into it would only hang
            self.progress("Ray is gone, and every actor with it")
        elif self._connected:
            from ray.util.placement_group import remove_placement_group

            for tier in tiers:
                self._stop_tier(tier)
            for group in groups:
                quietly(remove_placement_group, group)
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False
            self.progress("local Ray stopped")
        self._connected = False

    # ------------------------------------------------------------------ start steps

    def _members(self) -> list[Member]:
        return [*([self._redis] if self._redis else []), *self.workers,
                *([self.router] if self.router else [])]

    def _prepare(self) -> None:
        if self.spec.num_routers > 1 or self.spec.planner_args is not None:
            raise ClusterError("several router replicas (--routers) and the planner "
                               "(--planner) run without --ray only, for now; on Ray, run them "
                               "as your own processes")
        self.progress(f"logs in {self._make_log_dir()} (on each actor's node)")
        if self.spec.model_dir is None:
            self.progress("model: the built-in tiny model (each node builds it on first use)")
        elif not (Path(self.spec.model_dir) / "config.json").is_file():
            raise ClusterError(f"{self.spec.model_dir} is not a model directory (no config.json)")
        else:
            self.progress(f"model: {self.spec.model_dir} (the same path on every node)")
        self._connect()

    def _connect(self) -> None:
        prepare_ray_env(self.ray_spec)  # before Ray's first import: it reads it then
        import ray

        address = self.ray_spec.address
        if ray.is_initialized():
            self.progress("ray: using this process's Ray connection")
        else:
            try:
                init_ray(self.ray_spec)
            except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here
                what = "connect to" if address else "start"
                raise ClusterError(f"cannot {what} Ray {address or ''}: "
                                   f"{first_line(exc)}") from None
            self._owns_ray = address is None
        self._connected = True
        node_ip = ray.util.get_node_ip_address()
        if self._owns_ray:
            check_bound(self.spec.host, node_ip)
            self.progress(f"ray: started a local Ray on {node_ip} (dashboard off)")
        elif address is not None:
            alive = len([n for n in ray.nodes() if n["Alive"]])
            self.progress(f"ray: connected to {address} "
                          f"({alive} {'node' if alive == 1 else 'nodes'})")

    def _start_redis(self) -> None:
        if self._say_redis():
            return
        self.progress("starting redis-server ...")
        args = (str(self.log_dir), self.spec.stop_grace_s)
        actor = self._actor(RedisActor, "redis", args, num_cpus=0, max_restarts=0,
                            scheduling_strategy=pinned_here())
        self._redis = Member("redis", actor, restartable=False)
        self.redis_url = str(self._get(actor.url.remote(), "redis"))
        self.progress(f"redis ready at {redacted(self.redis_url)}")

    def _start_workers(self) -> None:
        plans = plan_workers(self.ray_spec)
        self._place(plans)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.redis_url is not None
        self.progress("starting " + ", ".join(f"{p.name} (TP {p.tp})" for p in plans) + " ...")
        for plan, group in zip(plans, self.placement_groups, strict=True):
            spec = worker_spec(self.ray_spec, plan, log_dir=str(self.log_dir),
                               redis_url=self.redis_url, token=self.cluster_token)
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
            actor = self._actor(SupervisedChild, plan.name, (spec,),
                                max_restarts=self.ray_spec.max_restarts,
                                scheduling_strategy=strategy, **actor_resources(plan.bundle))
            self.workers.append(Member(plan.name, actor, restartable=True))
        self._wait_ready(self.workers)

    def _place(self, plans: Sequence[WorkerPlan]) -> None:
        self.progress("placing " + ", ".join(f"{p.name} ({bundle_text(p.bundle)})"
                                             for p in plans) + " ...")
        # the router's group (on this node) is placed with the workers': a plan that leaves
        # it no room fails now, naming it
        self._router_bundle = router_bundle(self.ray_spec, this_node_ip())
        place_workers([*((p.name, p.bundle) for p in plans), ("router", self._router_bundle)],
                      self._name, self.ray_spec.placement_timeout_s, self.poll_s,
                      self._placement_groups)
        self._router_group = self._placement_groups[-1]
        self.progress(placed_text([p.name for p in plans], self.placement_groups))

    def _start_router(self) -> None:
        assert self.redis_url is not None
        self.progress(f"starting router on {self.spec.host}:{self.spec.port} ...")
        spec = router_spec(self.ray_spec, log_dir=str(self.log_dir), redis_url=self.redis_url,
                           api_key=os.environ.get(API_KEY_ENV) or None,
                           token=self.cluster_token)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self._router_group is not None  # placed with the workers'
        actor = self._actor(SupervisedChild, "router", (spec,), max_restarts=0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                self._router_group, placement_group_bundle_index=0),
                            **actor_resources(self._router_bundle))
        self.router = Member("router", actor, restartable=False)
        self._wait_ready([self.router])

    def _wait_ready(self, members: Sequence[Member]) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        pending = list(members)
        while pending:
            for member, status in zip(list(pending), poll(pending), strict=True):
                if status is not None and status.exit is not None:
                    raise ChildExited(member.name, f"{member.name} exited before it was "
                                                   f"ready ({status.exit}); {quote(status)}")
                if status is not None and status.ready is not None:
                    member.ready = status.ready
                    pending.remove(member)
                    self.progress(member.describe_ready())
            if pending and time.monotonic() > deadline:
                names = ", ".join(m.name for m in pending)
                raise ClusterError(f"not ready within {self.spec.start_timeout_s:.0f}s: "
                                   f"{names}; {quote(pending[0].status)}")
            if pending:
                time.sleep(self.poll_s)

    def _stop_tier(self, members: Sequence[Member]) -> None:
        if not members:
            return
        import ray

        grace = self.spec.stop_grace_s
        refs = [m.actor.stop.remote(grace) for m in members]
        quietly(ray.wait, refs, num_returns=len(refs), timeout=grace + 10.0)
        for member in members:
            quietly(ray.kill, member.actor, no_restart=True)

    # ------------------------------------------------------------------ Ray helpers

    def _name(self, name: str) -> str:
        return f"pdserve-{self.spec.name}-{name}"

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
                               f"with --cluster {self.spec.name} running on this Ray?)"
                               ) from None

    def _get(self, ref: Any, name: str) -> Any:
        """``ray.get`` in short steps (Ctrl-C stays responsive); a failed actor → ClusterError."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            try:
                return ray.get(ref, timeout=self.poll_s)
            except GetTimeoutError:
                if time.monotonic() > deadline:
                    raise ClusterError(f"{name} did not start within "
                                       f"{self.spec.start_timeout_s:.0f}s") from None
            except RayActorError as exc:
                raise ClusterError(f"{name} could not start: {first_line(exc)}") from None


def launch(ray_spec: RaySpec, progress: Callable[[str], None] | None = None) -> RayLauncher:
    """Starts ``ray_spec`` on Ray and returns the running launcher: ``router_address``,
    ``wait()``, ``stop()`` (the caller must call it, or use it as a context manager).
    ``ClusterError`` when it cannot start (after stopping what it started)."""
    return RayLauncher(ray_spec, progress).start()


def serve(ray_spec: RaySpec, *, on_ready: Callable[[Any], int | None] | None = None,
          progress: Callable[[str], None] | None = None) -> int:
    """``pdserve up --ray``: ``deploy.launcher.serve`` with the processes run by Ray."""
    say = progress or (lambda line: print(line, flush=True))
    return serve_launcher(RayLauncher(ray_spec, progress=say), on_ready=on_ready)
