"""``pdserve up --ray`` as plain data: what the launcher asks Ray for, and what each actor runs.

Torch-free and Ray-free (unit-tested without either): ``RaySpec``; the placement of
a tensor-parallel group (``worker_bundle``, ``actor_resources``); the child process of every
actor (``ChildSpec``, built on the driver; ``child_argv`` and ``child_env``, built on the
actor's node, which alone knows its IP and its GPU ids); and ``ChildStatus``, what an actor
reports. ``deploy.ray.actors`` runs the specs, ``deploy.ray.launcher`` places them.

Resources and GPUs. A worker of tensor-parallel size R gets a placement group of its own
(``STRICT_PACK``) holding one bundle ``{"CPU": R * cpus_per_rank, GPU: R}`` (GPU being
``gpu_resource``: Ray's ``GPU``, or a custom resource that stands in for it). The worker's
actor claims the whole bundle and runs ``pdserve prefill|decode --tensor-parallel-size R``,
which spawns ranks 1..R-1 itself. A bundle lives on one node, so a TP group never straddles
nodes, and the reservation outlives the actor: Ray restarts a dead worker in the same
bundle. With Ray's ``GPU`` resource Ray gives the actor R GPU ids; its child starts with
``CUDA_VISIBLE_DEVICES`` = rank 0's id and ``PDSERVE_RANK_GPUS`` = all R ids in rank order,
so every rank process sees exactly its own GPU (``worker.options.RANK_GPUS_ENV``).

Secrets (the Redis URL with its password, the router's API key, the cluster token) reach
the children in their environment only (``$PDSERVE_REDIS_URL``, ``$PDSERVE_API_KEY``,
``$PDSERVE_CLUSTER_TOKEN``), never on a command line. With a Redis of its own (the default)
the launcher generates the cluster token, so the workers' ports on the nodes' routable
addresses serve only the cluster's router.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deploy.children import child_env as base_child_env
from deploy.spec import (
    API_KEY_ENV,
    CLUSTER_TOKEN_ENV,
    REDIS_URL_ENV,
    WILDCARDS,
    ClusterSpec,
    WorkerSlot,
    planner_options,
    router_options,
    worker_options,
)
from worker.options import RANK_GPUS_ENV

DEVICES = ("cpu", "cuda")
RAY_GPU = "GPU"  # Ray's own GPU resource (it sets CUDA_VISIBLE_DEVICES for an actor)
WORKER_ROLES = ("prefill", "decode")
NAMESPACE = "pdserve"  # the Ray namespace of every actor the launcher creates


@dataclass(frozen=True)
class RaySpec:
    """``pdserve up --ray``: the processes of ``cluster`` run by Ray.

    ``address`` None starts a local Ray bound to ``cluster.host`` (dashboard off); "auto"
    or ``HOST:PORT`` connects to a running one. ``gpu_resource`` is what one rank reserves
    one unit of (default: Ray's ``GPU`` with ``device="cuda"``, nothing with ``"cpu"``);
    ``cpus_per_rank`` the CPUs it reserves. ``max_restarts``: how often Ray restarts each
    worker (-1: without limit; the router and Redis are not restarted).
    """

    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    address: str | None = None
    device: str = "cpu"  # the workers' --device
    gpu_resource: str | None = None
    cpus_per_rank: float = 1.0
    router_cpus: float = 1.0
    max_restarts: int = 3
    placement_timeout_s: float = 120.0  # for every placement group to be placed
    # the launcher adds and drains workers for the planner's scale target within these
    # (``deploy.ray.scaling``); max_workers None: it never does
    min_workers: int | None = None  # default 1
    max_workers: int | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.cpus_per_rank < 0 or self.router_cpus < 0:
            raise ValueError("cpus_per_rank and router_cpus must not be negative")
        if self.cpus_per_rank == 0 and self.rank_gpu_resource is None:
            raise ValueError("a rank must reserve something: give cpus_per_rank > 0 or a "
                             "gpu_resource")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be -1 (no limit) or more, got {self.max_restarts}")
        if self.address == "":
            raise ValueError("address must be None (a local Ray), 'auto' or HOST:PORT")
        if self.min_workers is not None and self.max_workers is None:
            raise ValueError("min_workers needs max_workers (the launcher then adds and "
                             "removes workers)")
        if self.max_workers is not None and not (
                1 <= (self.min_workers or 1) <= self.max_workers
                and len(self.cluster.workers) <= self.max_workers):
            raise ValueError(f"need 1 <= min_workers <= max_workers and the workers started "
                             f"({len(self.cluster.workers)}) <= max_workers, got "
                             f"{self.min_workers} and {self.max_workers}")
        if self.cluster.cpu_affinity:
            raise ValueError("cpu_affinity pins LocalLauncher's children; under Ray each rank "
                             "gets the CPUs its placement-group bundle reserves")

    @property
    def rank_gpu_resource(self) -> str | None:
        """The resource one rank reserves one unit of (None: CPUs only)."""
        if self.gpu_resource is not None:
            return self.gpu_resource
        return RAY_GPU if self.device == "cuda" else None


def worker_bundle(tp: int, *, cpus_per_rank: float, gpu_resource: str | None
                  ) -> dict[str, float]:
    """The one bundle of a worker's placement group: all ``tp`` ranks' resources, so the
    whole tensor-parallel group is reserved at once, on one node."""
    if tp < 1:
        raise ValueError(f"a worker has at least one rank, got {tp}")
    bundle = {"CPU": cpus_per_rank * tp} if cpus_per_rank else {}
    if gpu_resource is not None:
        bundle[gpu_resource] = float(tp)
    return bundle


NODE_SHARE = 0.001
"""Of a node's own resource (``node:<ip>``, 1 per node): pins a bundle to that node."""


def router_bundle(spec: RaySpec, node_ip: str) -> dict[str, float]:
    """The router's bundle: its CPUs (``router_cpus``), on the node ``pdserve up`` runs on
    (it binds ``--host`` there)."""
    bundle = {f"node:{node_ip}": NODE_SHARE}
    if spec.router_cpus:
        bundle["CPU"] = spec.router_cpus
    return bundle


def planned_cpus(spec: RaySpec) -> float:
    """The CPUs the whole plan reserves: every worker's bundle and each router's, and
    with ``max_workers`` the workers the launcher may add (of the larger TP)."""
    plans = plan_workers(spec)
    added = 0.0
    if spec.max_workers is not None:
        tp = max(spec.cluster.prefill_tp, spec.cluster.decode_tp)
        added = (spec.max_workers - len(plans)) * spec.cpus_per_rank * tp
    return sum(p.bundle.get("CPU", 0.0) for p in plans) + added \
        + spec.router_cpus * spec.cluster.num_routers


def local_ray_cpus(spec: RaySpec, host_cpus: int) -> int:
    """The CPUs a local Ray that pdserve starts declares: the machine's, or what the plan
    reserves if that is more (Ray's CPUs are logical: a plan larger than the machine
    shares its cores, as the same processes without Ray would)."""
    return max(host_cpus, math.ceil(planned_cpus(spec)))


def actor_resources(bundle: Mapping[str, float]) -> dict[str, Any]:
    """Ray actor options that claim exactly ``bundle`` (``num_cpus``/``num_gpus`` for Ray's
    own resources, ``resources`` for the rest)."""
    custom = {k: v for k, v in bundle.items() if k not in ("CPU", RAY_GPU)}
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get(RAY_GPU, 0),
            "resources": custom}


@dataclass(frozen=True)
class ChildSpec:
    """One ``python -m pdserve COMMAND ...`` process a Ray actor runs and supervises.

    ``options`` are what the driver knows (never a secret, never an address of the actor's
    node); ``secrets`` go into the child's environment only. A worker binds its node's IP
    (every interface when ``host`` is a wildcard) and advertises its node's IP; the router
    binds ``host``. ``restart``: the actor exits when its child dies after it was ready, so
    that Ray restarts both.
    """

    name: str  # "prefill-0", "decode-1", "router": names the log and ready files too
    command: str  # "prefill", "decode", "router" or "planner"
    options: tuple[str, ...]
    model_dir: str | None  # None: the built-in tiny model, built on the node on first use
    log_dir: str  # on the actor's node (created there)
    host: str  # the cluster's --host
    threads: int  # OMP_NUM_THREADS of each of its processes
    restart: bool
    secrets: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def is_worker(self) -> bool:
        return self.command in WORKER_ROLES


@dataclass(frozen=True)
class WorkerPlan:
    """One worker: its slot (name, role, tensor-parallel size) and placement-group bundle."""

    slot: WorkerSlot
    bundle: dict[str, float]

    @property
    def name(self) -> str:
        return self.slot.name

    @property
    def tp(self) -> int:
        return self.slot.tp


def plan_workers(spec: RaySpec) -> list[WorkerPlan]:
    """Every prefill worker, then every decode worker, with the bundle it reserves."""
    return [WorkerPlan(slot, worker_bundle(slot.tp, cpus_per_rank=spec.cpus_per_rank,
                                           gpu_resource=spec.rank_gpu_resource))
            for slot in spec.cluster.workers]


def worker_spec(spec: RaySpec, plan: WorkerPlan, *, log_dir: str, redis_url: str,
                token: str | None = None) -> ChildSpec:
    options = [*worker_options(spec.cluster, plan.slot), "--device", spec.device]
    secrets = [(REDIS_URL_ENV, redis_url)] + ([(CLUSTER_TOKEN_ENV, token)] if token else [])
    return ChildSpec(plan.name, plan.slot.role, tuple(options), _model(spec.cluster), log_dir,
                     spec.cluster.host, threads=max(1, int(spec.cpus_per_rank)), restart=True,
                     secrets=tuple(secrets))


def router_spec(spec: RaySpec, *, log_dir: str, redis_url: str, api_key: str | None,
                token: str | None = None, index: int = 0, extra: Sequence[str] = ()
                ) -> ChildSpec:
    """Router replica ``index`` (``extra``: options after the launcher's, e.g. the ports a
    restarted replica had)."""
    secrets = [(REDIS_URL_ENV, redis_url)] + ([(API_KEY_ENV, api_key)] if api_key else [])
    secrets += [(CLUSTER_TOKEN_ENV, token)] if token else []
    return ChildSpec(spec.cluster.router_names[index], "router",
                     (*router_options(spec.cluster, index), *extra), _model(spec.cluster),
                     log_dir, spec.cluster.host, threads=max(1, int(spec.router_cpus)),
                     restart=False, secrets=tuple(secrets))


def planner_spec(spec: RaySpec, *, log_dir: str, redis_url: str, token: str | None = None
                 ) -> ChildSpec:
    """The planner (``pdserve planner``, ``cluster.planner_args``), on the driver's node
    (its ``--profile`` is a path there)."""
    secrets = [(REDIS_URL_ENV, redis_url)] + ([(CLUSTER_TOKEN_ENV, token)] if token else [])
    return ChildSpec("planner", "planner", tuple(planner_options(spec.cluster)), None, log_dir,
                     spec.cluster.host,
                     threads=1, restart=False, secrets=tuple(secrets))


def _model(cluster: ClusterSpec) -> str | None:
    return None if cluster.model_dir is None else str(cluster.model_dir)


def child_argv(spec: ChildSpec, *, node_ip: str, model_dir: str, ready_path: str,
               python: str = sys.executable) -> list[str]:
    """The child's command line on a node whose IP is ``node_ip`` (the planner has no
    model: ``model_dir`` "")."""
    argv = [python, "-m", "pdserve", spec.command, *(["--model", model_dir] if model_dir
                                                     else [])]
    if spec.is_worker:
        bind = spec.host if spec.host in WILDCARDS else node_ip
        argv += ["--host", bind, "--advertise-host", node_ip]
    else:
        argv += ["--host", spec.host]
    return [*argv, *spec.options, "--ready-file", ready_path]


def child_env(spec: ChildSpec, *, base: Mapping[str, str], node_ip: str,
              gpu_ids: Sequence[str]) -> dict[str, str]:
    """The child's environment: ``base`` (the actor's) without secrets it was not given,
    plus its own secrets, its thread count, gloo and NCCL on loopback when the node's IP is, and its
    ranks' GPUs (``gpu_ids``, the actor's, in rank order)."""
    strip = (REDIS_URL_ENV, API_KEY_ENV, CLUSTER_TOKEN_ENV, RANK_GPUS_ENV, "OMP_NUM_THREADS")
    env = base_child_env({k: v for k, v in base.items() if k not in strip},
                         threads=spec.threads, host=node_ip)
    env.update(spec.secrets)
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids[0]  # the leader is rank 0
        env[RANK_GPUS_ENV] = ",".join(gpu_ids)
    return env


@dataclass(frozen=True)
class ChildStatus:
    """What an actor reports about its child (a worker, the router, Redis).

    ``actor_pid`` changes when Ray restarts the actor. ``ready`` is the child's ready file
    (None before it is written, again after each restart); ``exit`` says how the child
    ended (None while it runs) and ``log_tail`` then quotes its log.
    """

    name: str
    actor_pid: int
    node_ip: str
    child_pid: int | None
    ready: dict[str, Any] | None
    exit: str | None
    log_path: str
    log_tail: str = ""
