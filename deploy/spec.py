"""What a launcher places: ``ClusterSpec``, its checks, and the command-line options every
launcher gives the servers it starts (torch-free, standard library only).

A cluster (docs: the glossary) is the routers and workers that share one Redis under one
name. ``ClusterSpec`` says how many of each to start, on which model, bound where; a
launcher (``deploy.local``, ``deploy.ray``) turns it into processes. The options here are
the servers' own command lines (``pdserve router``, ``pdserve prefill|decode``): a launcher
reaches a server through them and its option module only, never through its internals.
Secrets (the Redis URL with its password, API keys, the cluster token) never go on a
command line: the launchers pass them in the environment (``REDIS_URL_ENV``,
``API_KEY_ENV``, ``CLUSTER_TOKEN_ENV``; ``cluster_token`` says which token).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from router.options import API_KEY_ENV, DEFAULT_HTTP_PORT, DEFAULT_PORT, LOCAL_PREFILL_MODES
from worker.options import CLUSTER_TOKEN_ENV, REDIS_URL_ENV, WILDCARDS

__all__ = ["API_KEY_ENV", "CLUSTER_TOKEN_ENV", "LOOPBACK", "REDIS_URL_ENV", "WILDCARDS",
           "ChildExited", "ClusterError", "ClusterSpec", "PortInUse", "WorkerSlot", "check_cpus",
           "check_port_free", "cluster_token", "is_loopback", "redacted", "router_options",
           "worker_options"]

LOOPBACK = "127.0.0.1"
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSlot:
    """One worker a launcher starts: ``prefill-0`` is role prefill, index 0, ``tp`` ranks."""

    role: str
    index: int
    tp: int

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class ClusterSpec:
    """The processes of one cluster. Counts are processes; ``*_tp`` ranks per worker."""

    model_dir: Path | None = None  # None: the built-in tiny model (built on first use)
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = LOOPBACK  # every endpoint binds here (a private Redis: loopback, or the node)
    port: int = DEFAULT_PORT  # the router's public API; 0: the OS picks
    http_port: int | None = DEFAULT_HTTP_PORT  # its OpenAI-compatible HTTP API; None: off
    # router replicas (``router``, ``router-1``, ...): replica i listens on port + i and
    # http_port + i (0 stays 0: each gets a free port)
    num_routers: int = 1
    chat_template: Path | None = None  # router's --chat-template
    redis_url: str | None = None  # None: a private redis-server the launcher starts
    # the cluster token's file; None: $PDSERVE_CLUSTER_TOKEN, else a generated one when the
    # launcher starts the Redis (nobody else can join that cluster), else none
    cluster_token_file: Path | None = None
    name: str = "default"  # the cluster's name: its Redis key namespace (``--cluster``)
    log_dir: Path | None = None  # None: a fresh temp dir
    num_kv_blocks: int | None = None  # per worker; None: fit to memory
    model_name: str | None = None  # router's --model-name
    max_inflight: int | None = None  # router's --max-inflight
    router_args: tuple[str, ...] = ()  # more of the router's flags, as given
    worker_args: tuple[str, ...] = ()  # more flags of every worker, as given
    # more flags of the workers started as decode workers only, after those (a worker
    # switched to another role later keeps what it started with)
    decode_args: tuple[str, ...] = ()
    # child name -> the CPUs it (and all it starts) runs on; absent: unpinned (local only)
    cpu_affinity: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    local_prefill: str = "never"  # router's --local-prefill; "always" allows 0 prefill workers
    start_router: bool = True  # False: Redis and workers only (run your own router)
    # None: no planner; else ``pdserve planner`` runs with these flags (--profile, SLOs)
    planner_args: tuple[str, ...] | None = None
    start_timeout_s: float = 300.0  # for all workers, then for the router, to be ready
    drain_s: float = 5.0  # workers' --grace: in-flight RPCs finish within it on SIGTERM
    stop_grace_s: float = 15.0  # per tier, from SIGTERM to SIGKILL

    def __post_init__(self) -> None:
        if self.local_prefill not in LOCAL_PREFILL_MODES:
            raise ValueError(f"local_prefill must be one of {LOCAL_PREFILL_MODES}, "
                             f"got {self.local_prefill!r}")
        for name in ("num_prefill", "num_decode", "prefill_tp", "decode_tp", "num_routers"):
            least = 0 if name == "num_prefill" and self.local_prefill == "always" else 1
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}"
                                 + (" (0 needs --local-prefill always)" if least else ""))
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
            if value and value + self.num_routers > 65536:
                raise ValueError(f"{self.num_routers} routers need {name} {value} and the "
                                 f"{self.num_routers - 1} after it, beyond 65535")
        names = {*self.worker_names, *self.router_names}
        for name, cpus in self.cpu_affinity.items():
            if name not in names:
                raise ValueError(f"cpu_affinity names {name!r}, not a process of this cluster "
                                 f"({', '.join(sorted(names))})")
            if not cpus or any(not isinstance(c, int) or c < 0 for c in cpus):
                raise ValueError(f"cpu_affinity[{name!r}] must be CPU numbers, got {cpus!r}")

    @property
    def workers(self) -> list[WorkerSlot]:
        """Every worker in start order: the prefill workers, then the decode workers."""
        return ([WorkerSlot("prefill", i, self.prefill_tp) for i in range(self.num_prefill)]
                + [WorkerSlot("decode", i, self.decode_tp) for i in range(self.num_decode)])

    @property
    def worker_names(self) -> list[str]:
        """The workers' names in start order (``prefill-0`` ..., ``decode-0`` ...)."""
        return [slot.name for slot in self.workers]

    @property
    def router_names(self) -> list[str]:
        """The routers' names: ``router``, then ``router-1``, ``router-2``, ..."""
        return ["router", *(f"router-{i}" for i in range(1, self.num_routers))]

    def router_ports(self, index: int) -> tuple[int, int | None]:
        """(gRPC port, HTTP port or None) of router replica ``index``."""
        def nth(port: int | None) -> int | None:
            return port + index if port else port
        port = nth(self.port)
        assert port is not None
        return port, nth(self.http_port)

    @property
    def num_ranks(self) -> int:
        """Engine processes in all (what shares the CPU cores)."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp


class ClusterError(RuntimeError):
    """The cluster could not start, or stopped serving (the message says which and why)."""


class PortInUse(ClusterError):
    pass


class ChildExited(ClusterError):
    """A process of the cluster exited on its own; ``name`` says which, the message quotes
    its log."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


# ------------------------------------------------------------------ the servers' options

def cluster_token(spec: ClusterSpec, environ: Mapping[str, str] = os.environ
                  ) -> tuple[str | None, bool]:
    """The cluster token text the launcher gives every child (in ``CLUSTER_TOKEN_ENV``),
    and whether it was generated here: ``spec.cluster_token_file``'s content, else
    ``$PDSERVE_CLUSTER_TOKEN``, else a fresh one for a cluster on a Redis of the launcher's
    own, else None (an external Redis's cluster keeps what its other processes use). The
    servers check its form; ``ClusterError`` for an unreadable or empty file."""
    if spec.cluster_token_file is not None:
        try:
            text = Path(spec.cluster_token_file).read_text().strip()
        except OSError as exc:
            raise ClusterError(f"cannot read the cluster token file {spec.cluster_token_file}: "
                               f"{exc.strerror}") from None
        if not text:
            raise ClusterError(f"the cluster token file {spec.cluster_token_file} is empty")
        return text, False
    if environ.get(CLUSTER_TOKEN_ENV, "").strip():
        return environ[CLUSTER_TOKEN_ENV].strip(), False
    if spec.redis_url is None:
        return secrets.token_urlsafe(32), True
    return None, False


def worker_options(spec: ClusterSpec, slot: WorkerSlot) -> list[str]:
    """``pdserve prefill|decode`` options every launcher gives ``slot`` (it adds where the
    worker binds, its model and its ready file)."""
    options = ["--worker-id", slot.name, "--tensor-parallel-size", str(slot.tp),
               "--cluster", spec.name, "--grace", str(spec.drain_s)]
    if spec.num_kv_blocks is not None:
        options += ["--num-kv-blocks", str(spec.num_kv_blocks)]
    return options + list(spec.worker_args) + (list(spec.decode_args)
                                               if slot.role == "decode" else [])


def router_options(spec: ClusterSpec, index: int = 0) -> list[str]:
    """``pdserve router`` options every launcher gives router replica ``index`` (it adds
    where the router binds, its model and its ready file); ``router_args`` last, so they
    win."""
    port, http_port = spec.router_ports(index)
    options = ["--port", str(port), "--cluster", spec.name,
               "--local-prefill", spec.local_prefill]
    if spec.model_name is not None:
        options += ["--model-name", spec.model_name]
    if spec.max_inflight is not None:
        options += ["--max-inflight", str(spec.max_inflight)]
    options += ["--no-http"] if http_port is None else ["--http-port", str(http_port)]
    if spec.chat_template is not None:
        options += ["--chat-template", str(spec.chat_template)]
    return options + list(spec.router_args)


def planner_options(spec: ClusterSpec) -> list[str]:
    """``pdserve planner`` options every launcher gives the planner (``planner_args``, and
    one prefill worker kept where the routers cannot prefill themselves)."""
    assert spec.planner_args is not None
    options = ["--cluster", spec.name, *spec.planner_args]
    if spec.local_prefill == "never" and "--min-prefill" not in options:
        options += ["--min-prefill", "1"]  # the routers cannot serve without one
    return options


# ------------------------------------------------------------------ checks

def check_cpus(affinity: Mapping[str, Sequence[int]]) -> None:
    """``ClusterError`` when a pinned child would be given a CPU this process may not use."""
    if not affinity:
        return
    if not hasattr(os, "sched_getaffinity"):
        raise ClusterError("pinning children to CPUs needs Linux (os.sched_setaffinity)")
    allowed = os.sched_getaffinity(0)
    for name, cpus in affinity.items():
        if not set(cpus) <= allowed:
            raise ClusterError(f"{name} is to run on CPUs {sorted(cpus)}, but this process "
                               f"may use only {sorted(allowed)}")


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """``PortInUse`` when something listens on (or holds) ``host:port``; port 0 passes."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((host, port), family=family):
            pass
    except OSError as exc:
        raise PortInUse(f"port {port} on {host} is not available ({exc.strerror or exc}); "
                        f"pick another with {flag} (0: any free port)") from None


def check_ports(spec: ClusterSpec) -> None:
    """The router's ports are free (before anything starts; a no-router spec has none)."""
    if spec.start_router:
        for index in range(spec.num_routers):
            port, http_port = spec.router_ports(index)
            check_port_free(spec.host, port)
            if http_port is not None:
                check_port_free(spec.host, http_port, "--http-port")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def redacted(url: str) -> str:
    """``url`` without its password (for printing)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))
