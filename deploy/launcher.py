"""The launcher skeleton every way of placing a cluster implements, and ``serve``, the loop
of ``pdserve up`` around any of them.

``Launcher.start`` runs the one start order — the router's ports checked (a taken one fails
before anything starts) → ``_prepare`` (log directory, model) → the cluster token
(``deploy.spec.cluster_token``; a generated one is written to ``LOG_DIR/cluster.token``,
mode 0600, for processes of your own, and removed by ``stop``) → Redis (a private one unless
``ClusterSpec.redis_url`` names one) → every worker, each ready once it has registered →
the router — and on any failure stops what it started, then re-raises. ``stop`` runs the
reverse (router: stops accepting and finishes its streams; workers: drain and deregister;
Redis), each tier SIGTERM then SIGKILL after ``stop_grace_s``; it is idempotent and also
runs after a failed start. ``wait`` watches the processes until one is gone for good
(``ChildExited``). Implementations: ``deploy.local.LocalLauncher`` (child processes of this
one) and ``deploy.ray.RayLauncher`` (Ray actors, a placement group per worker).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from deploy.spec import ClusterError, ClusterSpec, check_ports, cluster_token, redacted

POLL_S = 0.1
RESTART_POLL_S = 0.5  # how soon ``serve`` acts on a SIGHUP


class Launcher(ABC):
    """Starts and stops the processes of ``spec`` (a context manager); ``progress`` gets one
    line per step. See the module docstring for the order of things."""

    def __init__(self, spec: ClusterSpec, progress: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.progress = progress or (lambda _line: None)
        self.log_dir: Path | None = Path(spec.log_dir) if spec.log_dir is not None else None
        self.redis_url: str | None = spec.redis_url
        self.cluster_token: str | None = None  # what every child gets in its environment
        self._token_file: Path | None = None  # where a generated token was written

    def __enter__(self) -> Launcher:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> Launcher:
        """Start every process; returns once all are ready (``ClusterError`` otherwise,
        after stopping what it started). Once: entering the context manager starts it too."""
        if self.started:
            raise RuntimeError(f"this {type(self).__name__} is started already")
        try:
            check_ports(self.spec)
            self._prepare()
            self._resolve_token()
            self._start_redis()
            self._start_workers()
            if self.spec.start_router:
                self._start_router()
            if self.spec.planner_args is not None:
                self._start_planner()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Router, then every worker, then Redis (see the module docstring)."""
        started = self.started
        if started:
            self.progress("stopping ...")
        self._stop_processes()
        if self._token_file is not None:  # the token of a cluster that is gone
            self._token_file.unlink(missing_ok=True)
            self._token_file = None
        if started:
            self.progress("all processes stopped")

    def wait(self, timeout_s: float | None = None) -> None:
        """Returns after ``timeout_s`` (never with None) unless a process is gone for good:
        then raises ``ChildExited``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            self.check()
            time.sleep(self.poll_s)
        self.check()

    @property
    def router_address(self) -> str:
        """``HOST:PORT`` of the public API (from the router's ready file)."""
        return self._reachable(str(self._router_ready()["grpc_address"]))

    @property
    def router_addresses(self) -> list[str]:
        """``HOST:PORT`` of every router replica's public API (``pdserve.Client`` takes
        the list: it spreads calls over them and resumes a broken stream elsewhere)."""
        return [self._reachable(str(r["grpc_address"])) for r in self._routers_ready()]

    @property
    def http_url(self) -> str:
        """``http://HOST:PORT`` of the OpenAI-compatible HTTP API."""
        address = self._router_ready().get("http_address")
        if address is None:
            raise RuntimeError("the router serves no HTTP API (http_port is None)")
        return f"http://{self._reachable(str(address))}"

    # ------------------------------------------------------------------ implementations

    poll_s = POLL_S

    @property
    @abstractmethod
    def started(self) -> bool:
        """Whether any process (or resource) of the cluster was started and not stopped."""

    @abstractmethod
    def check(self) -> None:
        """Once over every process: ``ChildExited`` when one is gone for good."""

    @abstractmethod
    def _prepare(self) -> None:
        """The log directory and the model, before any process starts."""

    @abstractmethod
    def _start_redis(self) -> None:
        """A private Redis (sets ``redis_url``) unless the spec names one."""

    @abstractmethod
    def _start_workers(self) -> None:
        """Every worker of ``spec.workers``, all at once; returns when all are ready."""

    @abstractmethod
    def _start_router(self) -> None:
        """The router; returns when it serves."""

    def _start_planner(self) -> None:
        """The planner (``spec.planner_args``); returns when it runs."""
        raise ClusterError(f"the planner (--planner) runs without --ray only, for now "
                           f"({type(self).__name__}); run pdserve planner yourself")

    @abstractmethod
    def _stop_processes(self) -> None:
        """Router, workers, Redis, in that order; then whatever else was acquired."""

    def _routers_ready(self) -> list[dict[str, Any]]:
        """Every router replica's ready file (one router unless an implementation runs
        several)."""
        return [self._router_ready()]

    can_restart = False  # whether ``rolling_restart`` (SIGHUP to ``pdserve up``) works

    def rolling_restart(self) -> None:
        """Restarts every process but Redis, one at a time (``ClusterError`` where this
        launcher cannot)."""
        raise ClusterError(f"{type(self).__name__} cannot restart its processes in place")

    @abstractmethod
    def _router_ready(self) -> dict[str, Any]:
        """The router's ready file (``RuntimeError`` when it is not running)."""

    def _reachable(self, address: str) -> str:
        """``address`` as a client here reaches it (a wildcard bind made concrete)."""
        return address

    def _make_log_dir(self) -> Path:
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir

    def _resolve_token(self) -> None:
        token, generated = cluster_token(self.spec)
        self.cluster_token = token
        if token is None or not generated:
            if token is None:
                self.progress("no cluster token: the workers' internal API and KV channels are "
                              "open to anyone who can reach them")
            return
        where = ""
        if self.log_dir is not None:
            path = self.log_dir / "cluster.token"
            path.unlink(missing_ok=True)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(token + "\n")
            self._token_file = path
            where = f" ({path}, for processes of your own: --cluster-token-file)"
        self.progress(f"generated the cluster token{where}")

    def _say_redis(self) -> bool:
        """Reports a given Redis URL; True when there is one (nothing to start)."""
        if self.redis_url is None:
            return False
        self.progress(f"using Redis at {redacted(self.redis_url)}")
        return True


# ------------------------------------------------------------------ pdserve up


def pdserve_command() -> str:
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


def serve(launcher: Launcher, *, on_ready: Callable[[Any], int | None] | None = None) -> int:
    """``pdserve up``: start ``launcher``, call ``on_ready(launcher)`` (a non-zero result
    stops with that exit code), serve until SIGINT/SIGTERM (exit 0) or until a process is
    gone (``ClusterError``: reported on stderr, exit 1), and stop everything; a SIGHUP
    meanwhile restarts every process in place, one at a time (``rolling_restart``). Its
    lines go to ``launcher.progress``. Main thread only."""
    say = launcher.progress
    spec = launcher.spec
    # installed, not inherited: a shell starts background jobs with SIGINT ignored
    previous_int = signal.signal(signal.SIGINT, _interrupt)
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        launcher.start()
        code = on_ready(launcher) if on_ready is not None else None
        if code:
            return code
        if spec.start_router:
            addresses = launcher.router_addresses
            say(f"pdserve is serving at {', '.join(addresses)} (Ctrl-C to stop); try:\n"
                f"  {pdserve_command()} generate \"Hello\" --address {','.join(addresses)}")
            if spec.http_port is not None:
                say(f"OpenAI-compatible HTTP API at {launcher.http_url}/v1; try:\n"
                    f"  curl {launcher.http_url}/v1/completions -H 'Content-Type: "
                    f"application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'")
            if launcher.can_restart:
                say(f"kill -HUP {os.getpid()} restarts every process in place, one at a time")
        else:
            say("workers are serving without a router; Redis at "
                f"{redacted(launcher.redis_url or '')} (Ctrl-C to stop)")
        restart = threading.Event()
        previous_hup = signal.signal(signal.SIGHUP, lambda *_: restart.set())
        try:
            while True:  # until a process is gone (ChildExited) or an interrupt
                launcher.wait(RESTART_POLL_S)
                if restart.is_set() and not launcher.can_restart:
                    restart.clear()
                    say(f"SIGHUP ignored: {type(launcher).__name__} cannot restart its "
                        "processes in place")
                elif restart.is_set():
                    restart.clear()
                    say("SIGHUP: restarting every process, one at a time ...")
                    launcher.rolling_restart()
                    say("rolling restart done")
        finally:
            signal.signal(signal.SIGHUP, previous_hup)
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
            launcher.stop()
        finally:
            signal.signal(signal.SIGINT, previous_int if previous_int is not None
                          else signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous_term)
