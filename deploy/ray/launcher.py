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

Scaling (``deploy.ray.scaling``, with ``max_workers``): the planner's steps run on a
thread of their own while ``wait()`` goes on checking the others. A worker being added is
not checked until it is ready; one being drained leaves the checked members before its
SIGTERM. Both are stopped, and their placement groups removed, if the cluster stops
meanwhile. A step and a restart never run at once.

Failures. A worker whose child dies after it was ready is restarted by Ray in the same
placement group (up to ``max_restarts``) and registers again; the router routes to the
others meanwhile. ``wait()`` reports that through ``progress`` and raises ``ChildExited``
when a worker cannot come back (restarts spent, or its new child failed before it was
ready), or when the router or Redis dies (neither is restarted). Actors and placement
groups are the driver's (not detached): Ray removes them when this process dies, however.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deploy.launcher import Launcher
from deploy.launcher import serve as serve_launcher
from deploy.ray.actors import RedisActor, SupervisedChild
from deploy.ray.connect import (
    bundle_text,
    connect,
    gcs_reachable,
    pinned_here,
    place_workers,
    placed_text,
    quietly,
    this_node_ip,
)
from deploy.ray.members import (
    Member,
    get_within,
    new_actor,
    poll,
    stop_tier,
    wait_ready,
)
from deploy.ray.motion import InMotion, RayScaling
from deploy.ray.plan import (
    ChildStatus,
    RaySpec,
    WorkerPlan,
    actor_resources,
    plan_workers,
    planner_spec,
    router_bundle,
    router_spec,
    worker_spec,
)
from deploy.ray.restarts import RayRestarts
from deploy.ray.scaling import Scaler
from deploy.spec import API_KEY_ENV, WILDCARDS, ClusterError, redacted

_CONCURRENCY = 4  # an actor answers status() while stop() waits for its child


class RayLauncher(RayScaling, RayRestarts, Launcher):
    """Starts and stops ``ray_spec`` on Ray (a context manager; see the module docstring).
    ``stop()`` removes every actor and placement group it created (idempotent)."""

    poll_s = 0.25

    def __init__(self, ray_spec: RaySpec, progress: Callable[[str], None] | None = None) -> None:
        super().__init__(ray_spec.cluster, progress)
        self.ray_spec = ray_spec
        self.workers: list[Member] = []
        self.routers: list[Member] = []  # the replicas, in ``spec.router_names`` order
        self._redis: Member | None = None
        self.planner: Member | None = None  # with --planner, on this node
        self.scaler: Scaler | None = None  # with max_workers: applies the planner's steps
        self._placement_groups: list[Any] = []  # the workers', then the routers'
        self._router_groups: list[Any] = []  # placed with the workers' groups, on this node
        self._router_bundle: dict[str, float] = {}
        self._owns_ray = False
        self._connected = False
        self._changing = threading.Lock()  # a scale step or a restart, one at a time
        self._lists = threading.Lock()  # the members' lists, against the stop path
        self._in_motion: list[InMotion] = []
        self._stopping = threading.Event()

    def __enter__(self) -> RayLauncher:
        return self.start()

    def start(self) -> RayLauncher:
        super().start()
        return self

    @property
    def started(self) -> bool:
        return bool(self._members()) or bool(self._placement_groups) or self._connected

    @property
    def router(self) -> Member | None:
        """The first router replica (None when none runs)."""
        return self.routers[0] if self.routers else None

    @property
    def placement_groups(self) -> list[Any]:
        """The workers' placement groups (one per worker, in ``workers`` order)."""
        return [g for g in self._placement_groups
                if not any(g is r for r in self._router_groups)]

    def statuses(self) -> dict[str, ChildStatus]:
        """Name → the latest status of every actor started and not yet stopped."""
        return {m.name: m.status for m in self._members() if m.status is not None}

    def check(self) -> None:
        """Follows every actor once: reports restarts; ``ChildExited`` when one is gone."""
        members = self._members()
        for member, status in zip(members, poll(members), strict=True):
            member.follow(status, self.progress)
        if self.scaler is not None:
            self.scaler.poll()  # a step runs on its own thread: the next check is not held up

    def _router_ready(self) -> dict[str, Any]:
        return self._routers_ready()[0]

    def _routers_ready(self) -> list[dict[str, Any]]:
        if not self.routers or any(r.ready is None or r.status is None for r in self.routers):
            raise RuntimeError("the router is not running")
        return [r.ready for r in self.routers if r.ready is not None]

    def _reachable(self, address: str) -> str:
        """The node's IP when the router binds a wildcard."""
        assert self.router is not None and self.router.status is not None
        host, _, port = address.rpartition(":")
        return f"{self.router.status.node_ip if host in WILDCARDS else host}:{port}"

    def _stop_processes(self) -> None:
        self._stopping.set()  # a scale step running adds nothing from now on
        with self._lists:
            moving, self._in_motion = self._in_motion, []
            # the planner first: it must not switch a role or scale while the rest stops
            tiers = [[self.planner] if self.planner else [], self.routers,
                     [*self.workers, *(m.member for m in moving if m.member is not None)],
                     [self._redis] if self._redis else []]
            groups, self._placement_groups, self._router_groups = (
                [*self._placement_groups, *(g for m in moving for g in m.groups)], [], [])
            self.routers, self.workers, self._redis, self.planner = [], [], None, None
        scaler, self.scaler = self.scaler, None
        if self._connected and not gcs_reachable():
            # Ray went first (e.g. a SIGTERM to the whole process group): its actors, and
            # with them their children, are gone; calls into it would only hang
            self.progress("Ray is gone, and every actor with it")
        elif self._connected:
            from ray.util.placement_group import remove_placement_group

            for tier in tiers:
                stop_tier(tier, self.spec.stop_grace_s)
            if scaler is not None:  # its worker is stopped: the step ends soon (its own
                scaler.join(2 * self.spec.stop_grace_s + 30.0)  # stop waits as long)
            for group in groups:
                quietly(remove_placement_group, group)
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False
            self.progress("local Ray stopped")
        self._connected = False
        if scaler is not None:
            scaler.close()

    # ------------------------------------------------------------------ start steps

    def _members(self) -> list[Member]:
        return [*([self._redis] if self._redis else []), *self.workers, *self.routers,
                *([self.planner] if self.planner else [])]

    def _prepare(self) -> None:
        self._stopping.clear()
        self.progress(f"logs in {self._make_log_dir()} (on each actor's node)")
        if self.spec.model_dir is None:
            self.progress("model: the built-in tiny model (each node builds it on first use)")
        elif not (Path(self.spec.model_dir) / "config.json").is_file():
            raise ClusterError(f"{self.spec.model_dir} is not a model directory (no config.json)")
        else:
            self.progress(f"model: {self.spec.model_dir} (the same path on every node)")
        try:
            self._owns_ray = connect(self.ray_spec, self.progress)
        finally:
            import ray

            self._connected = ray.is_initialized()

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
        assert self.redis_url is not None
        self.progress("starting " + ", ".join(f"{p.name} (TP {p.tp})" for p in plans) + " ...")
        self.workers = [self._spawn_worker(plan, group)
                        for plan, group in zip(plans, self.placement_groups, strict=True)]
        self._wait_ready(self.workers)
        if self.ray_spec.max_workers is not None:
            self.scaler = Scaler(self, self.redis_url)

    def _spawn_worker(self, plan: WorkerPlan, group: Any) -> Member:
        """The actor of worker ``plan``, in its placement group ``group``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.redis_url is not None
        spec = worker_spec(self.ray_spec, plan, log_dir=str(self.log_dir),
                           redis_url=self.redis_url, token=self.cluster_token)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        actor = self._actor(SupervisedChild, plan.name, (spec,),
                            max_restarts=self.ray_spec.max_restarts,
                            scheduling_strategy=strategy, **actor_resources(plan.bundle))
        return Member(plan.name, actor, restartable=True, plan=plan)

    def _group_name(self, name: str) -> str:
        return f"pdserve-{self.spec.name}-{name}"

    def _place(self, plans: Sequence[WorkerPlan]) -> None:
        self.progress("placing " + ", ".join(f"{p.name} ({bundle_text(p.bundle)})"
                                             for p in plans) + " ...")
        # the routers' groups (on this node) are placed with the workers': a plan that
        # leaves them no room fails now, naming them
        self._router_bundle = router_bundle(self.ray_spec, this_node_ip())
        routers = self.spec.router_names
        place_workers([*((p.name, p.bundle) for p in plans),
                       *((name, self._router_bundle) for name in routers)],
                      self._group_name,
                      self.ray_spec.placement_timeout_s, self.poll_s,
                      self._placement_groups)
        self._router_groups = self._placement_groups[len(plans):]
        self.progress(placed_text([p.name for p in plans], self.placement_groups))

    def _start_router(self) -> None:
        ports = ", ".join(str(self.spec.router_ports(i)[0]) for i in range(self.spec.num_routers))
        self.progress(f"starting {'router' if self.spec.num_routers == 1 else 'routers'} on "
                      f"{self.spec.host}:{ports} ...")
        self.routers = [self._spawn_router(i) for i in range(self.spec.num_routers)]
        self._wait_ready(self.routers)

    def _spawn_router(self, index: int, extra: Sequence[str] = ()) -> Member:
        """Router replica ``index``'s actor, in its placement group (``extra``: more
        options)."""
        assert self.redis_url is not None
        spec = router_spec(self.ray_spec, log_dir=str(self.log_dir), redis_url=self.redis_url,
                           api_key=os.environ.get(API_KEY_ENV) or None,
                           token=self.cluster_token, index=index, extra=extra)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = self._actor(SupervisedChild, spec.name, (spec,), max_restarts=0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                self._router_groups[index], placement_group_bundle_index=0),
                            **actor_resources(self._router_bundle))
        return Member(spec.name, actor, restartable=False)

    def _start_planner(self) -> None:
        assert self.redis_url is not None
        self.progress("starting the planner ...")
        spec = planner_spec(self.ray_spec, log_dir=str(self.log_dir), redis_url=self.redis_url,
                            token=self.cluster_token)
        actor = self._actor(SupervisedChild, "planner", (spec,), num_cpus=0, max_restarts=0,
                            scheduling_strategy=pinned_here())
        self.planner = Member("planner", actor, restartable=False)
        self._wait_ready([self.planner])

    # ------------------------------------------------------------------ restarts

    def _wait_ready(self, members: Sequence[Member]) -> None:
        wait_ready(members, self.spec.start_timeout_s, self.poll_s, self.progress)

    def _actor(self, cls: type, name: str, args: tuple[Any, ...], **options: Any) -> Any:
        return new_actor(self.spec.name, cls, name, args, max_concurrency=_CONCURRENCY,
                         **options)

    def _get(self, ref: Any, name: str) -> Any:
        return get_within(ref, name, self.spec.start_timeout_s, self.poll_s)


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
