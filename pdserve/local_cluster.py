"""``pdserve up``: a whole cluster on one machine — Redis, prefill and decode workers, router.

Torch-free (the built-in model is built through ``engine.tiny_model`` only when no model
directory is given). Every process is a child started through ``pdserve.child_process``:
in its own session (a terminal's Ctrl-C reaches only the supervisor, which then stops the
children in order) and SIGKILLed by the kernel when the supervisor dies, however it dies.
Worker rank processes die with their worker.

Order of start: port check (a taken router port fails before anything starts) → model →
Redis (a private ``redis-server`` on a free loopback port unless a URL is given) → all
workers at once, each ready once its ready file appears (it has registered in Redis by
then) → router. Order of stop: router (stops accepting, finishes its streams) → workers
(they drain and deregister) → Redis; each tier gets SIGTERM and ``stop_grace_s``, then
SIGKILL. Each child's stdout/stderr goes to ``LOG_DIR/NAME.log``; failures quote its tail.

Pinning (``cpu_affinity``, for benchmarks; off by default): a child named there
(``prefill-0``, ``decode-1``, ``router``) runs on those CPUs only, and so does everything it
starts (set before it execs, ``pdserve.child_process.spawn``); it gets one torch thread per
CPU unless ``OMP_NUM_THREADS`` is set. Children not named run where this process may.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pdserve.child_process import spawn, terminate_all
from pdserve.redis_server import RedisServer, RedisServerError
from router.config import DEFAULT_HTTP_PORT, DEFAULT_PORT

LOOPBACK = "127.0.0.1"
_POLL_S = 0.1
_LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class LocalClusterConfig:
    """What ``pdserve up`` starts. Counts are processes; ``*_tp`` ranks per worker."""

    model_dir: Path | None = None  # None: the built-in tiny model (built on first use)
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = LOOPBACK  # every endpoint binds here (the private Redis: always loopback)
    port: int = DEFAULT_PORT  # the router's public API; 0: the OS picks
    http_port: int | None = DEFAULT_HTTP_PORT  # its OpenAI-compatible HTTP API; None: off
    chat_template: Path | None = None  # router's --chat-template
    redis_url: str | None = None  # None: a private redis-server on a free loopback port
    cluster: str = "default"  # Redis key namespace
    log_dir: Path | None = None  # None: a fresh temp dir
    num_kv_blocks: int | None = None  # per worker; None: fit to memory
    model_name: str | None = None  # router's --model-name
    max_inflight: int | None = None  # router's --max-inflight
    router_args: tuple[str, ...] = ()  # more of the router's flags, as given
    worker_args: tuple[str, ...] = ()  # more flags of every worker, as given
    # child name -> the CPUs it (and all it starts) runs on; absent: unpinned (see module doc)
    cpu_affinity: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    local_prefill: str = "never"  # router's --local-prefill; "always" allows 0 prefill workers
    start_router: bool = True  # False: Redis and workers only (run your own router)
    start_timeout_s: float = 300.0  # for all workers, then for the router, to be ready
    drain_s: float = 5.0  # workers' --grace: in-flight RPCs finish within it on SIGTERM
    stop_grace_s: float = 15.0  # per tier, from SIGTERM to SIGKILL

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "prefill_tp", "decode_tp"):
            least = 0 if name == "num_prefill" and self.local_prefill == "always" else 1
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}"
                                 + (" (0 needs --local-prefill always)" if least else ""))
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        names = {*self.worker_names, "router"}
        for name, cpus in self.cpu_affinity.items():
            if name not in names:
                raise ValueError(f"cpu_affinity names {name!r}, not a process of this cluster "
                                 f"({', '.join(sorted(names))})")
            if not cpus or any(not isinstance(c, int) or c < 0 for c in cpus):
                raise ValueError(f"cpu_affinity[{name!r}] must be CPU numbers, got {cpus!r}")

    @property
    def worker_names(self) -> list[str]:
        """The workers' names in start order (``prefill-0`` ..., ``decode-0`` ...)."""
        return ([f"prefill-{i}" for i in range(self.num_prefill)]
                + [f"decode-{i}" for i in range(self.num_decode)])

    @property
    def num_ranks(self) -> int:
        """Engine processes in all (what shares the CPU cores)."""
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp


class ClusterError(RuntimeError):
    """The cluster could not start, or stopped serving (the message says which and why)."""


class PortInUse(ClusterError):
    pass


class ChildExited(ClusterError):
    """A child process exited on its own; ``name`` says which, the message quotes its log."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass
class Child:
    """One process of the cluster; ``ready`` holds its ready file's JSON once it appears."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    ready: dict[str, Any] | None = None

    @property
    def address(self) -> str:
        """The gRPC address from the ready file ("?" before it is ready)."""
        return str((self.ready or {}).get("grpc_address", "?"))

    def exited(self, when: str) -> ChildExited:
        return ChildExited(self.name, f"{self.name} exited {when} ({_describe(self.proc)}); "
                                      f"{_tail_text(self.log_path)}")


class LocalCluster:
    """Starts and stops the processes of ``config`` (a context manager).

    ``start()`` returns once every process is ready (``ClusterError`` otherwise, after
    stopping what it started); ``progress`` gets one line per step. ``wait()`` watches the
    children; ``stop()`` stops them all (idempotent; also after a failed start).
    """

    def __init__(self, config: LocalClusterConfig,
                 progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._progress = progress or (lambda _line: None)
        self.log_dir = Path(config.log_dir) if config.log_dir is not None else None
        self.model_dir: Path | None = None
        self.redis_url: str | None = config.redis_url
        self._redis: RedisServer | None = None
        self.workers: list[Child] = []
        self.router: Child | None = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def router_address(self) -> str:
        """``HOST:PORT`` of the public API (the router's ready file)."""
        if self.router is None or self.router.ready is None:
            raise RuntimeError("the router is not running")
        return self.router.address

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the OpenAI-compatible HTTP API (the router's ready file)."""
        if self.router is None or self.router.ready is None:
            raise RuntimeError("the router is not running")
        address = self.router.ready.get("http_address")
        if address is None:
            raise RuntimeError("the router serves no HTTP API (http_port is None)")
        return f"http://{address}"

    def pids(self) -> dict[str, int]:
        """Name → pid of every process started and not yet stopped."""
        pids = {c.name: c.proc.pid for c in self._children()}
        if self._redis is not None and self._redis.pid is not None:
            pids["redis"] = self._redis.pid
        return pids

    def start(self) -> LocalCluster:
        """Start every process (once: entering the context manager starts it too)."""
        if self._children():
            raise RuntimeError("this LocalCluster is started already")
        check_cpus(self.config.cpu_affinity)
        try:
            if self.config.start_router:
                check_port_free(self.config.host, self.config.port)
                if self.config.http_port is not None:
                    check_port_free(self.config.host, self.config.http_port, "--http-port")
            self._prepare()
            self._start_redis()
            self._start_workers()
            if self.config.start_router:
                self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def check(self) -> None:
        """Raises ``ChildExited`` when a process of the cluster is no longer running."""
        for child in self._children():
            if child.proc.poll() is not None:
                raise child.exited("unexpectedly")
        if self._redis is not None and not self._redis.running:
            raise ChildExited("redis", f"redis-server exited unexpectedly; its log ends with:\n"
                                       f"{self._redis.log_tail()}")

    def wait(self, timeout_s: float | None = None) -> None:
        """Returns after ``timeout_s`` (never with None) unless a child exits: then raises
        ``ChildExited``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            self.check()
            time.sleep(_POLL_S)
        self.check()

    def stop(self) -> None:
        """Router, then all workers, then Redis: SIGTERM, SIGKILL after the grace period."""
        grace = self.config.stop_grace_s
        router, self.router = self.router, None
        workers, self.workers = self.workers, []
        redis_server, self._redis = self._redis, None
        started = router is not None or bool(workers) or redis_server is not None
        if started:
            self._progress("stopping ...")
        if router is not None:
            terminate_all([router.proc], grace)
        if workers:
            terminate_all([w.proc for w in workers], grace)
        if redis_server is not None:
            redis_server.stop()
        for child in [*workers, *([router] if router is not None else [])]:
            child.ready_path.unlink(missing_ok=True)  # it no longer tells the truth
        if started:
            self._progress("all processes stopped")

    # ------------------------------------------------------------------ start steps

    def _children(self) -> list[Child]:
        return [*self.workers, *([self.router] if self.router is not None else [])]

    def _prepare(self) -> None:
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._progress(f"logs in {self.log_dir}")
        if self.config.model_dir is None:
            self._progress("preparing the built-in tiny model (built on first use) ...")
            from engine.tiny_model import ensure_demo_model

            self.model_dir = ensure_demo_model()
        else:
            self.model_dir = Path(self.config.model_dir)
            if not (self.model_dir / "config.json").is_file():
                raise ClusterError(f"{self.model_dir} is not a model directory (no config.json)")
        self._progress(f"model: {self.model_dir}")

    def _start_redis(self) -> None:
        if self.redis_url is not None:
            self._progress(f"using Redis at {_redacted(self.redis_url)}")
            return
        assert self.log_dir is not None
        self._progress("starting redis-server ...")
        self._redis = RedisServer(log_path=self.log_dir / "redis.log",
                                  stop_grace_s=self.config.stop_grace_s)
        try:
            self._redis.start()
        except RedisServerError as exc:
            raise ClusterError(str(exc)) from None
        self.redis_url = self._redis.url
        self._progress(f"redis ready at {self.redis_url}")

    def _start_workers(self) -> None:
        cfg = self.config
        plan = [("prefill", i, cfg.prefill_tp) for i in range(cfg.num_prefill)]
        plan += [("decode", i, cfg.decode_tp) for i in range(cfg.num_decode)]
        self._progress("starting " + ", ".join(f"{role}-{i} (TP {tp})" for role, i, tp in plan)
                       + " ...")
        for role, i, tp in plan:
            self.workers.append(self._spawn(f"{role}-{i}", self._worker_argv(role, i, tp)))
        self._wait_ready(self.workers, self._describe_worker)

    def _start_router(self) -> None:
        cfg = self.config
        self._progress(f"starting router on {cfg.host}:{cfg.port} ...")
        argv = [*self._pdserve("router"), "--host", cfg.host, "--port", str(cfg.port)]
        if cfg.model_name is not None:
            argv += ["--model-name", cfg.model_name]
        if cfg.max_inflight is not None:
            argv += ["--max-inflight", str(cfg.max_inflight)]
        argv += list(cfg.router_args)
        argv += ["--local-prefill", cfg.local_prefill]
        argv += ["--no-http"] if cfg.http_port is None else ["--http-port", str(cfg.http_port)]
        if cfg.chat_template is not None:
            argv += ["--chat-template", str(cfg.chat_template)]
        self.router = self._spawn("router", argv)
        self._wait_ready([self.router], lambda c: f"router ready at {c.address}" + (
            f" (HTTP {c.ready['http_address']})" if c.ready and "http_address" in c.ready
            else ""))

    def _worker_argv(self, role: str, index: int, tp: int) -> list[str]:
        cfg = self.config
        argv = [*self._pdserve(role), "--host", cfg.host, "--worker-id", f"{role}-{index}",
                "--tensor-parallel-size", str(tp), "--grace", str(cfg.drain_s)]
        if cfg.num_kv_blocks is not None:
            argv += ["--num-kv-blocks", str(cfg.num_kv_blocks)]
        return argv + list(cfg.worker_args)

    def _pdserve(self, command: str) -> list[str]:
        assert self.redis_url is not None
        return [sys.executable, "-m", "pdserve", command, "--model", str(self.model_dir),
                "--redis-url", self.redis_url, "--cluster", self.config.cluster]

    def _spawn(self, name: str, argv: list[str]) -> Child:
        assert self.log_dir is not None
        ready_path = self.log_dir / f"{name}.ready.json"
        ready_path.unlink(missing_ok=True)  # a stale one from an earlier run in this dir
        log_path = self.log_dir / f"{name}.log"
        cpus = self.config.cpu_affinity.get(name)
        with open(log_path, "wb") as log:
            proc = spawn([*argv, "--ready-file", str(ready_path)], stdout=log,
                         stderr=subprocess.STDOUT, env=child_env(self.config, cpus), cpus=cpus)
        return Child(name, proc, log_path, ready_path)

    def _wait_ready(self, children: list[Child], describe: Callable[[Child], str]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        pending = list(children)
        while pending:
            for child in list(pending):
                if child.proc.poll() is not None:
                    raise child.exited("before it was ready")
                if child.ready_path.exists():
                    child.ready = json.loads(child.ready_path.read_text())
                    pending.remove(child)
                    self._progress(describe(child))
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise ClusterError(f"not ready within {self.config.start_timeout_s:.0f}s: "
                                   f"{names}; {_tail_text(pending[0].log_path)}")
            time.sleep(_POLL_S if pending else 0)

    @staticmethod
    def _describe_worker(child: Child) -> str:
        ready = child.ready or {}
        extra = [f"{what} {ready[key]}" for what, key in (("KV", "kv_address"),
                                                          ("metrics", "metrics_address"))
                 if ready.get(key)]
        return f"{child.name} ready at {child.address}" + (f" ({', '.join(extra)})" if extra
                                                          else "")


def child_env(config: LocalClusterConfig, cpus: Sequence[int] | None = None) -> dict[str, str]:
    """A child's environment: ours, plus its thread count unless set already (one per CPU
    of a child pinned to ``cpus``; else the cores shared among all ranks), unbuffered
    output, and gloo bound to loopback when the cluster is."""
    env = dict(os.environ)
    threads = len(cpus) if cpus else max(1, (os.cpu_count() or 1) // config.num_ranks)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if _is_loopback(config.host):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


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


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _describe(proc: subprocess.Popen[bytes]) -> str:
    code = proc.returncode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _tail_text(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    except OSError:
        return f"no log at {path}"
    if not lines:
        return f"its log {path} is empty"
    return f"the end of its log {path}:\n" + "\n".join("    " + line for line in lines)


def _redacted(url: str) -> str:
    """``url`` without its password (for printing)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = netloc[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))


# ------------------------------------------------------------------ the command


def _pdserve_command() -> str:
    """How to run ``pdserve`` from here: the name when PATH finds ours, else our script's
    path (relative when it is under the working directory, as ``.venv/bin/pdserve``)."""
    script = Path(sys.executable).parent / "pdserve"
    found = shutil.which("pdserve")
    if found is not None and Path(found).resolve() == script.resolve():
        return "pdserve"
    if not script.exists():
        return f"{sys.executable} -m pdserve"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve(config: LocalClusterConfig, *,
          on_ready: Callable[[Any], int | None] | None = None,
          progress: Callable[[str], None] | None = None,
          make_cluster: Callable[[Callable[[str], None]], Any] | None = None) -> int:
    """``pdserve up``: start ``config``, call ``on_ready`` (a non-zero result stops with
    that exit code), serve until SIGINT/SIGTERM (exit 0) or until a child exits
    (``ClusterError``: reported on stderr, exit 1), and stop everything. Main thread only.
    ``make_cluster(progress)`` builds what is served instead of a ``LocalCluster`` of
    ``config`` (``pdserve up --ray``: a ``pdserve.ray_cluster.RayCluster``, which has the
    same ``start``, ``wait``, ``stop``, ``router_address`` and ``redis_url``).
    """
    say = progress or (lambda line: print(line, flush=True))
    # installed, not inherited: a shell starts background jobs with SIGINT ignored
    previous_int = signal.signal(signal.SIGINT, _interrupt)
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    cluster = (make_cluster(say) if make_cluster is not None
               else LocalCluster(config, progress=say))
    try:
        cluster.start()
        code = on_ready(cluster) if on_ready is not None else None
        if code:
            return code
        if config.start_router:
            say(f"pdserve is serving at {cluster.router_address} (Ctrl-C to stop); try:\n"
                f"  {_pdserve_command()} generate \"Hello\" --address {cluster.router_address}")
            if config.http_port is not None:
                say(f"OpenAI-compatible HTTP API at {cluster.http_url}/v1; try:\n"
                    f"  curl {cluster.http_url}/v1/completions -H 'Content-Type: "
                    f"application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'")
        else:
            say("workers are serving without a router; Redis at "
                f"{_redacted(cluster.redis_url or '')} (Ctrl-C to stop)")
        cluster.wait()
        return 0  # unreachable: wait() returns only by raising
    except KeyboardInterrupt:
        say("interrupted")
        return 0
    except ClusterError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Stopping is bounded by the grace periods; a second Ctrl-C must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            cluster.stop()
        finally:
            signal.signal(signal.SIGINT, previous_int if previous_int is not None
                          else signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous_term)
