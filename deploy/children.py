"""Child processes that die with the process that started them, even when it is SIGKILLed,
and what every launcher says about them: their environment, how one ended, its log's end.

Torch-free. On Linux a child is exec'ed from a tiny trampoline that first sets
``PR_SET_PDEATHSIG=SIGKILL`` (no ``preexec_fn``, so no fork-with-threads hazards) and bails
out if its parent is already gone (the race before ``prctl``); the death signal survives
``execve``. Because that signal fires when the *thread* that forked the child exits, every
spawn happens on one long-lived daemon thread (``_SpawnThread``): spawning from a
short-lived thread (an executor, a test helper) would kill the child with that thread.

Each child runs in its own session (so its process group id is its pid): a terminal's
Ctrl-C reaches only the parent, which then stops its children in order. Grandchildren are
the child's business (worker rank processes die with their worker), but ``terminate``
SIGKILLs the whole group of a child that ignored SIGTERM.

CPU pinning (``spawn(..., cpus=[...])``, Linux): the trampoline sets the CPU affinity
before it execs the child, so every thread and process the child ever starts (OpenMP
pools, rank processes) inherits it; nothing runs unpinned for a moment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from typing import Any

from deploy.spec import is_loopback

LOG_TAIL_BYTES = 4000
LOG_TAIL_LINES = 30

# Runs as ``python -I -S -c _TRAMPOLINE PARENT_PID CPUS EXECUTABLE ARGS...`` (CPUS: a
# comma-separated CPU list, or empty to keep the parent's affinity).
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:\n"
    "    sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('parent exited before the child started')\n"
    "if sys.argv[2]:\n"
    "    os.sched_setaffinity(0, [int(c) for c in sys.argv[2].split(',')])\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


def spawn(argv: Sequence[str], *, cpus: Sequence[int] | None = None,
          **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` (``argv[0]`` a path to an executable) as a child that is SIGKILLed
    when this process dies, in its own session, with stdin from /dev/null and no inherited
    file descriptors; pinned to ``cpus`` (and so is everything it starts) when given
    (Linux only: ``ValueError`` elsewhere, or for an empty list). Other ``Popen``
    arguments (``stdout``, ``stderr``, ``cwd``, ``env``) pass through. The caller owns
    the returned process: stop it with ``terminate``.
    """
    argv = list(argv)
    linux = sys.platform.startswith("linux")
    if cpus is not None and (not linux or not cpus):
        raise ValueError(f"cannot pin to CPUs {list(cpus)} here (Linux only, at least one)")
    if linux:
        cpu_list = ",".join(str(int(c)) for c in cpus) if cpus is not None else ""
        argv = [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), cpu_list,
                *argv]
    kwargs: dict[str, Any] = {"stdin": subprocess.DEVNULL, "close_fds": True,
                              "start_new_session": True, **popen_kwargs}
    return _SPAWNER.popen(argv, **kwargs)


def terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, then SIGKILL (to its whole process group) after ``grace_s``; reaps it."""
    terminate_all([proc], grace_s)


def terminate_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """``terminate`` for several children at once: all get SIGTERM together and share one
    grace period, so stopping N children takes ``grace_s`` at most, not N times it."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(proc)
    for proc in procs:
        proc.wait(10.0)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child and everything in its process group. Only while the child is not
    yet reaped: its pid (= the group id, see ``spawn``) cannot have been reused then."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not a group leader after all
        proc.kill()


class _SpawnThread:
    """Runs every ``Popen`` on one daemon thread that lives as long as the process."""

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
                                                name="pdserve-spawner")
                self._thread.start()
            self._jobs.put((future, argv, kwargs))
        try:
            return future.result()
        except BaseException:  # e.g. Ctrl-C while waiting: the child must not go unowned
            future.add_done_callback(_kill_unowned)
            raise

    def _serve(self) -> None:
        while True:
            future, argv, kwargs = self._jobs.get()
            try:
                future.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)


def _kill_unowned(future: Future[subprocess.Popen[bytes]]) -> None:
    if future.exception() is None:
        proc = future.result()
        kill_group(proc)
        proc.wait()


_SPAWNER = _SpawnThread()


def child_env(base: Mapping[str, str], *, threads: int, host: str) -> dict[str, str]:
    """A child's environment: ``base``, its torch thread count (``OMP_NUM_THREADS``, unless
    ``base`` sets it), unbuffered output, and gloo and NCCL bound to loopback when ``host`` (what
    the child binds) is a loopback address (NCCL's bootstrap sockets would pick another
    interface)."""
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if is_loopback(host):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return env


def describe_exit(returncode: int | None) -> str:
    """How a child ended: "killed by SIGKILL", "exit code 3"."""
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def log_tail(path: str | Path, num_bytes: int = LOG_TAIL_BYTES, *, start: int = 0) -> str:
    """The end of the log at ``path``, from offset ``start`` at the earliest ("" when there
    is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - num_bytes))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def quote_log(path: str | Path, text: str | None = None, *, where: str = "") -> str:
    """The end of a child's log for an error message: its last ``LOG_TAIL_LINES`` lines
    (of ``text``, else of the file at ``path``), indented, after where the log is
    (``where``: e.g. " on 10.0.0.7")."""
    if text is None:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            return f"no log at {path}{where}"
    lines = text.strip().splitlines()[-LOG_TAIL_LINES:]
    if not lines:
        return f"its log {path}{where} is empty"
    return f"the end of its log {path}{where}:\n" + "\n".join("    " + line for line in lines)
