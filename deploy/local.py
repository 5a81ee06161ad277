"""``pdserve up``: a whole cluster on this machine, every process a child of this one.

Torch-free (the built-in model is built through the engine's test models only when no
model directory is given). Every process is a child started through ``deploy.children``:
in its own session (a terminal's Ctrl-C reaches only the supervisor, which then stops the
children in order) and SIGKILLed by the kernel when the supervisor dies, however it dies.
Worker rank processes die with their worker. The start and stop order is the launcher
skeleton's (``deploy.launcher``); the private Redis listens on a free loopback port and
has a generated password. Each child's stdout/stderr goes to ``LOG_DIR/NAME.log``;
failures quote its tail; the logs stay when the cluster stops. The Redis URL and the cluster
token reach the children in their environment only (``LOG_DIR/redis.url`` and a generated
``LOG_DIR/cluster.token``, for processes of your own, go when it stops).

Pinning (``ClusterSpec.cpu_affinity``, for benchmarks; off by default): a child named
there (``prefill-0``, ``decode-1``, ``router``) runs on those CPUs only, and so does
everything it starts (set before it execs, ``deploy.children.spawn``); it gets one torch
thread per CPU unless ``OMP_NUM_THREADS`` is set. Children not named run where this
process may.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.children import child_env, describe_exit, quote_log, spawn, terminate_all
from deploy.launcher import Launcher
from deploy.redis_server import RedisServer, RedisServerError
from deploy.spec import (
    CLUSTER_TOKEN_ENV,
    REDIS_URL_ENV,
    ChildExited,
    ClusterError,
    ClusterSpec,
    check_cpus,
    planner_options,
    redacted,
    router_options,
    worker_options,
)

RESTART_SETTLE_S = 2.0
"""After restarting a child, how long ``rolling_restart`` waits before the next one (the
routers' view of the workers refreshes every 0.5 s)."""


@dataclass
class Child:
    """One process of the cluster; ``ready`` holds its ready file's JSON once it appears."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    ready: dict[str, Any] | None = None
    argv: tuple[str, ...] = ()  # how it was started (its ready file's flag not included)

    @property
    def address(self) -> str:
        """The gRPC address from the ready file ("?" before it is ready)."""
        return str((self.ready or {}).get("grpc_address", "?"))

    def exited(self, when: str) -> ChildExited:
        return ChildExited(self.name, f"{self.name} exited {when} "
                                      f"({describe_exit(self.proc.returncode)}); "
                                      f"{quote_log(self.log_path)}")


class LocalLauncher(Launcher):
    """The cluster of ``spec`` as child processes of this one (see the module docstring).
    ``workers`` and ``routers`` are the running children (``router`` the first router);
    ``pids()`` names every process; ``restart``/``rolling_restart`` replace them in place."""

    can_restart = True

    def __init__(self, spec: ClusterSpec, progress: Callable[[str], None] | None = None) -> None:
        super().__init__(spec, progress)
        self.model_dir: Path | None = None
        self._redis: RedisServer | None = None
        self.workers: list[Child] = []
        self.routers: list[Child] = []
        self.planners: list[Child] = []  # the planner, with --planner

    @property
    def router(self) -> Child | None:
        """The first router replica (None when none runs)."""
        return self.routers[0] if self.routers else None

    @property
    def started(self) -> bool:
        return bool(self._children()) or self._redis is not None

    def pids(self) -> dict[str, int]:
        """Name → pid of every process started and not yet stopped."""
        pids = {c.name: c.proc.pid for c in self._children()}
        if self._redis is not None and self._redis.pid is not None:
            pids["redis"] = self._redis.pid
        return pids

    def start(self) -> LocalLauncher:
        check_cpus(self.spec.cpu_affinity)
        super().start()
        return self

    def __enter__(self) -> LocalLauncher:
        return self.start()

    def check(self) -> None:
        for child in self._children():
            if child.proc.poll() is not None:
                raise child.exited("unexpectedly")
        if self._redis is not None and not self._redis.running:
            raise ChildExited("redis", f"redis-server exited unexpectedly; its log ends with:\n"
                                       f"{self._redis.log_tail()}")

    def _router_ready(self) -> dict[str, Any]:
        return self._routers_ready()[0]

    def _routers_ready(self) -> list[dict[str, Any]]:
        if not self.routers or any(r.ready is None for r in self.routers):
            raise RuntimeError("the router is not running")
        return [r.ready for r in self.routers if r.ready is not None]

    def _stop_processes(self) -> None:
        """Each group is forgotten once it stopped (a second Ctrl-C midway leaves the rest
        to a later stop, never untracked)."""
        grace = self.spec.stop_grace_s
        stopped: list[Child] = []
        # the planner first: it must not switch a role while the rest stops
        for group in ("planners", "routers", "workers"):
            children: list[Child] = getattr(self, group)
            if children:
                terminate_all([c.proc for c in children], grace)
            stopped += children
            setattr(self, group, [])
        redis_server, self._redis = self._redis, None
        if redis_server is not None:
            try:
                redis_server.stop()
            finally:
                if self.log_dir is not None:  # its URL, password included, no longer serves
                    (self.log_dir / "redis.url").unlink(missing_ok=True)
        for child in stopped:
            child.ready_path.unlink(missing_ok=True)  # it no longer tells the truth

    # ------------------------------------------------------------------ restarts

    def restart(self, name: str) -> Child:
        """Replaces child ``name`` in place: SIGTERM (it drains: a router ends its streams
        for their clients to resume elsewhere, a decode worker's streams migrate, a
        prefill worker's queue goes elsewhere), then the same command — a router on the
        ports it had — until ready. Its peers keep serving meanwhile."""
        children = {c.name: c for c in self._children()}
        if name not in children:
            raise ClusterError(f"no process named {name!r} (there are "
                               f"{', '.join(sorted(children))})")
        old = children[name]
        self.progress(f"restarting {name} ...")
        terminate_all([old.proc], self.spec.stop_grace_s)
        argv = list(old.argv)
        if name in self.spec.router_names and old.ready is not None:  # the same ports
            argv += ["--port", str(old.ready["grpc_address"]).rpartition(":")[2]]
            if "http_address" in old.ready:
                argv += ["--http-port", str(old.ready["http_address"]).rpartition(":")[2]]
        group = next(g for g in (self.routers, self.workers, self.planners) if old in g)
        new = self._spawn(name, argv)
        group[group.index(old)] = new
        self._wait_ready([new], self._describe_worker)
        return new

    def rolling_restart(self, settle_s: float = RESTART_SETTLE_S) -> None:
        """Restarts every child, one at a time — the routers, then the prefill workers,
        then the decode workers — waiting ``settle_s`` after each (for the routers to see
        a worker back) before the next. Serving goes on without a failed request where
        every kind has at least two processes (and clients know every router)."""
        names = [*self.spec.router_names, *self.spec.worker_names]
        for name in names:
            self.restart(name)
            time.sleep(settle_s)

    # ------------------------------------------------------------------ start steps

    def _children(self) -> list[Child]:
        return [*self.workers, *self.routers, *self.planners]

    def _prepare(self) -> None:
        self.progress(f"logs in {self._make_log_dir()}")
        if self.spec.model_dir is None:
            self.progress("preparing the built-in tiny model (built on first use) ...")
            from engine.testing.tiny_model import ensure_demo_model

            self.model_dir = ensure_demo_model()
        else:
            self.model_dir = Path(self.spec.model_dir)
            if not (self.model_dir / "config.json").is_file():
                raise ClusterError(f"{self.model_dir} is not a model directory (no config.json)")
        self.progress(f"model: {self.model_dir}")

    def _start_redis(self) -> None:
        if self._say_redis():
            return
        assert self.log_dir is not None
        self.progress("starting redis-server ...")
        self._redis = RedisServer(log_path=self.log_dir / "redis.log",
                                  password=secrets.token_hex(16),
                                  stop_grace_s=self.spec.stop_grace_s)
        try:
            self._redis.start()
        except RedisServerError as exc:
            raise ClusterError(str(exc)) from None
        self.redis_url = self._redis.url
        url_file = self.log_dir / "redis.url"  # for a router of your own (--no-router)
        url_file.unlink(missing_ok=True)
        with os.fdopen(os.open(url_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(self.redis_url + "\n")
        self.progress(f"redis ready at {redacted(self.redis_url)} (its URL with the generated "
                      f"password: {url_file})")

    def _start_workers(self) -> None:
        slots = self.spec.workers
        self.progress("starting " + ", ".join(f"{s.name} (TP {s.tp})" for s in slots) + " ...")
        for slot in slots:
            argv = [*self._pdserve(slot.role), *worker_options(self.spec, slot)]
            self.workers.append(self._spawn(slot.name, argv))
        self._wait_ready(self.workers, self._describe_worker)

    def _start_router(self) -> None:
        spec = self.spec
        ports = ", ".join(str(spec.router_ports(i)[0]) for i in range(spec.num_routers))
        self.progress(f"starting {'router' if spec.num_routers == 1 else 'routers'} on "
                      f"{spec.host}:{ports} ...")
        self.routers = [self._spawn(name, [*self._pdserve("router"), *router_options(spec, i)])
                        for i, name in enumerate(spec.router_names)]
        self._wait_ready(self.routers, self._describe_worker)

    def _start_planner(self) -> None:
        spec = self.spec
        argv = [sys.executable, "-m", "pdserve", "planner", "--host", spec.host,
                *planner_options(spec)]
        self.progress("starting the planner ...")
        self.planners = [self._spawn("planner", argv)]
        self._wait_ready(self.planners, lambda c: f"planner ready (metrics "
                                                  f"{(c.ready or {}).get('metrics_address')})")

    def _pdserve(self, command: str) -> list[str]:
        return [sys.executable, "-m", "pdserve", command, "--model", str(self.model_dir),
                "--host", self.spec.host]

    def _spawn(self, name: str, argv: list[str]) -> Child:
        assert self.log_dir is not None and self.redis_url is not None
        ready_path = self.log_dir / f"{name}.ready.json"
        ready_path.unlink(missing_ok=True)  # a stale one from an earlier run in this dir
        log_path = self.log_dir / f"{name}.log"
        cpus = self.spec.cpu_affinity.get(name)
        env = {**self.child_env(cpus), REDIS_URL_ENV: self.redis_url}
        if self.cluster_token is not None:
            env[CLUSTER_TOKEN_ENV] = self.cluster_token
        with open(log_path, "ab") as log:  # a restarted child's log goes on after its last
            proc = spawn([*argv, "--ready-file", str(ready_path)], stdout=log,
                         stderr=subprocess.STDOUT, env=env, cpus=cpus)
        return Child(name, proc, log_path, ready_path, argv=tuple(argv))

    def child_env(self, cpus: Sequence[int] | None = None) -> dict[str, str]:
        """A child's environment: ours, with its thread count unless set already (one per
        CPU of a child pinned to ``cpus``; else the cores shared among all ranks)."""
        threads = len(cpus) if cpus else max(1, (os.cpu_count() or 1) // self.spec.num_ranks)
        return child_env(os.environ, threads=threads, host=self.spec.host)

    def _wait_ready(self, children: list[Child], describe: Callable[[Child], str]) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.proc.poll() is not None:
                    raise child.exited("before it was ready")
                if child.ready_path.exists():
                    child.ready = json.loads(child.ready_path.read_text())
                    pending.remove(child)
                    self.progress(describe(child))
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise ClusterError(f"not ready within {self.spec.start_timeout_s:.0f}s: "
                                   f"{names}; {quote_log(pending[0].log_path)}")
            time.sleep(self.poll_s if pending else 0)

    @staticmethod
    def _describe_worker(child: Child) -> str:
        """``NAME ready at ADDRESS (KV ..., metrics ..., HTTP ...)``, what it has of those."""
        ready = child.ready or {}
        extra = [f"{what} {ready[key]}" for what, key in (("KV", "kv_address"),
                                                          ("metrics", "metrics_address"),
                                                          ("HTTP", "http_address"))
                 if ready.get(key)]
        return f"{child.name} ready at {child.address}" + (f" ({', '.join(extra)})" if extra
                                                          else "")
