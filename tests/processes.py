"""Real processes for tests: the one spawner, the one ``wait_until`` and /proc helpers.

``spawn`` starts ``python -m pdserve ARGS --ready-file ...`` with its output in a log file
(its tail goes into assertion messages), one torch thread and gloo on loopback;
``Proc.wait_ready`` waits for the ready file; ``Proc.stop`` stops it with SIGTERM → SIGKILL
(bounded) and kills any child (rank) process left. Layer-specific helpers build on these:
``tests.worker.procs`` (worker processes and their leak check), ``tests.e2e.cluster``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tests.factories import REPO_ROOT

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Proc:
    """One spawned ``python -m pdserve ROLE ...`` process and its ready file."""

    name: str  # unique in its directory: names the log and ready files
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    ready: dict[str, Any] = field(default_factory=dict)
    child_pids: list[int] = field(default_factory=list)  # e.g. a worker's rank processes
    _channel: grpc.Channel | None = None

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    @property
    def address(self) -> str:
        return str(self.ready["grpc_address"])

    @property
    def channel(self) -> grpc.Channel:
        """A channel to its gRPC address (once ready), closed by ``stop``."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return self._channel

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout_s
        while not self.ready_path.exists():
            assert self.proc.poll() is None, f"{self.name} exited:\n{self.log_tail()}"
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.log_tail()}"
            time.sleep(0.1)
        self.ready = json.loads(self.ready_path.read_text())
        self.child_pids = children(self.proc.pid)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stops the process (and SIGKILLs any child left); returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # harmless unless it was stopped
            self.proc.send_signal(sig)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for pid in self.child_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        return self.proc.returncode


def spawn(name: str, args: Sequence[str], tmp: Path, env: dict[str, str] | None = None) -> Proc:
    """``python -m pdserve ARGS --ready-file ...`` with its output in ``tmp/NAME.log``
    (``env``: extra environment variables). A router gets ``--http-port 0`` unless ARGS
    choose its HTTP port."""
    if args and args[0] == "router" and not {"--http-port", "--no-http"} & set(args):
        args = [*args, "--http-port", "0"]  # routers run side by side in tests
    log_path, ready_path = tmp / f"{name}.log", tmp / f"{name}.ready.json"
    ready_path.unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *args, "--ready-file", str(ready_path)],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})})
    return Proc(name, proc, log_path, ready_path)


def start_all(procs: Sequence[Proc]) -> None:
    """Wait until every one of ``procs`` is ready; stop them all if one is not."""
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        stop_all(procs)
        raise


def stop_all(procs: Sequence[Proc]) -> None:
    for p in procs:
        p.stop()


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid``, zombies included (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str,
               period_s: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> float:
    """Poll ``predicate`` until it is true (an exception of ``ignore`` counts as false);
    returns the seconds it took, fails the test after ``timeout_s``."""
    start = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - start
        except ignore:
            pass
        assert time.monotonic() - start < timeout_s, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(period_s)


def listening(pid: int) -> list[str]:
    """``host:port`` of every TCP socket ``pid`` listens on (from its /proc entries)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(_proc_net_address(cols[1]))
    return found


def _proc_net_address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s ``HEX:PORT`` (addresses as host-order 32-bit words)."""
    host, port = hex_address.split(":")
    words = bytes.fromhex(host)
    raw = b"".join(words[i:i + 4][::-1] for i in range(0, len(words), 4))
    if len(raw) == 16 and raw[:12] == bytes(10) + b"\xff\xff":  # IPv4-mapped IPv6
        raw = raw[12:]
    if len(raw) == 4:
        return f"{'.'.join(str(b) for b in raw)}:{int(port, 16)}"
    return f"[{raw.hex()}]:{int(port, 16)}"  # any other IPv6 address: named as is
