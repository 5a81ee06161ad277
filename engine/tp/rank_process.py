"""Follower ranks of a tensor-parallel engine as programs of their own.

A follower is started as ``python -m engine.tp.rank_main --steps-fd S --replies-fd R``: a
fresh interpreter that never imports the user's ``__main__`` (so ``python -``,
``python -c`` and scripts without a ``__main__`` guard work), with two pipes passed as
file descriptors and wrapped in ``multiprocessing.connection.Connection``:

- steps (leader → rank): first a ``RankLaunch`` (versioned JSON), then ``StepMessage`` s;
- replies (rank → leader): ``RankStatus`` HELLO (about to join the group) and READY
  (model loaded), then plugin call replies.

The rank's stderr is a pipe the leader copies to its own stderr, keeping the last lines:
when a rank exits, or does not answer in time, during start-up, ``RankStartError``
quotes them. Start-up waits poll every follower's liveness, so a rank that fails is
reported within a fraction of a second of its exit — never after a rendezvous timeout.
"""

from __future__ import annotations

import collections
import enum
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import IO, Any, TypeVar

from engine.config import EngineConfig
from engine.kernels.linear import KernelPlan
from engine.tp.config_codec import engine_config_from_wire, engine_config_to_wire

LAUNCH_VERSION = 1
RANK_MAIN_MODULE = "engine.tp.rank_main"
_POLL_S = 0.1
_STDERR_TAIL_LINES = 40
_T = TypeVar("_T")


class RankStartError(RuntimeError):
    """A follower rank exited, or did not answer in time, while the engine started; the
    message carries the end of the rank's stderr (its traceback)."""


@dataclass(frozen=True)
class RankLaunch:
    """Everything a follower rank is started with (the first message on its steps pipe).

    ``kernel_plan``: the linear kernels the leader chose, which every rank applies.
    ``sys_path``: the leader's import path, appended to the rank's own, so rank plugins
    the leader can import are importable on the rank too.
    """

    rank: int
    config: EngineConfig
    store_host: str
    store_port: int
    num_kv_blocks: int
    threads: int
    parent_pid: int
    kernel_plan: KernelPlan
    sys_path: tuple[str, ...] = ()

    def encode(self) -> bytes:
        return json.dumps({
            "version": LAUNCH_VERSION, "rank": self.rank,
            "config": engine_config_to_wire(self.config),
            "store_host": self.store_host, "store_port": self.store_port,
            "num_kv_blocks": self.num_kv_blocks, "threads": self.threads,
            "parent_pid": self.parent_pid, "sys_path": list(self.sys_path),
            "kernel_plan": {"kernels": [list(k) for k in self.kernel_plan.kernels],
                            "source": self.kernel_plan.source},
        }).encode()

    @classmethod
    def decode(cls, data: bytes) -> RankLaunch:
        """Inverse of ``encode``; raises ``ValueError`` on another version or a bad field."""
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("version") != LAUNCH_VERSION:
            version = raw.get("version") if isinstance(raw, dict) else None
            raise ValueError(f"rank launch message version {version!r}, "
                             f"this rank reads {LAUNCH_VERSION}")
        try:
            ints = {k: raw[k] for k in ("rank", "store_port", "num_kv_blocks", "threads",
                                        "parent_pid")}
            host, sys_path, config = raw["store_host"], raw["sys_path"], raw["config"]
            plan = _decode_plan(raw["kernel_plan"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed rank launch message: {exc!r}") from None
        if (any(type(v) is not int for v in ints.values()) or type(host) is not str
                or not isinstance(sys_path, list) or not all(type(p) is str for p in sys_path)):
            raise ValueError(f"malformed rank launch message: {raw!r}")
        return cls(config=engine_config_from_wire(config), store_host=host,
                   sys_path=tuple(sys_path), kernel_plan=plan, **ints)


def _decode_plan(raw: Any) -> KernelPlan:
    entries, source = raw["kernels"], raw["source"]
    if type(source) is not str or not all(
            isinstance(e, list) and len(e) == 3 and type(e[0]) is int and type(e[1]) is int
            and type(e[2]) is str for e in entries):
        raise TypeError(f"malformed kernel plan {raw!r}")
    return KernelPlan(tuple((e[0], e[1], e[2]) for e in entries), source)


class StatusKind(enum.IntEnum):
    HELLO = 1  # value: the rank's pid; sent just before it joins the TP group
    READY = 2  # value: parameter elements the rank holds; sent once it can run steps


_STATUS = struct.Struct("<qqq")  # kind, rank, value


@dataclass(frozen=True)
class RankStatus:
    kind: StatusKind
    rank: int
    value: int

    def encode(self) -> bytes:
        return _STATUS.pack(int(self.kind), self.rank, self.value)

    @classmethod
    def decode(cls, data: bytes) -> RankStatus:
        if len(data) != _STATUS.size:
            raise ValueError(f"malformed rank status message of {len(data)} bytes")
        kind, rank, value = _STATUS.unpack(data)
        return cls(StatusKind(kind), rank, value)


class _StderrTail:
    """Copies a child's stderr to this process's stderr (fd 2), keeping its last lines."""

    def __init__(self, stream: IO[bytes], name: str) -> None:
        self._stream = stream
        self._lines: collections.deque[bytes] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._thread = threading.Thread(target=self._pump, name=name, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        with self._stream:
            for line in iter(self._stream.readline, b""):
                self._lines.append(line)
                try:
                    os.write(2, line)
                except OSError:
                    pass  # no stderr to copy to: keep the tail only

    def text(self, wait_s: float = 0.0) -> str:
        """The last lines (after waiting up to ``wait_s`` for the stream to end)."""
        self._thread.join(wait_s)
        return b"".join(self._lines).decode(errors="replace").rstrip()


def _rank_env() -> dict[str, str]:
    """This process's environment, with the directory holding ``engine`` first on the
    rank's import path (the leader may have found it through its own ``sys.path``)."""
    root = str(Path(__file__).resolve().parents[2])  # engine/tp/rank_process.py
    path = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class RankProcess:
    """The leader's handle on one follower rank process (see the module docstring).

    ``steps``: the leader writes step messages; ``replies``: the rank's statuses and
    plugin replies. ``stop`` ends the process (politely, then by force); idempotent.
    """

    def __init__(self, launch: RankLaunch) -> None:
        self.rank = launch.rank
        steps_r, steps_w = os.pipe()
        replies_r, replies_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", RANK_MAIN_MODULE,
                 "--steps-fd", str(steps_r), "--replies-fd", str(replies_w)],
                pass_fds=(steps_r, replies_w), stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE, env=_rank_env())
        except BaseException:
            os.close(steps_w)
            os.close(replies_r)
            raise
        finally:
            os.close(steps_r)  # the rank's ends: only the rank holds them now
            os.close(replies_w)
        self.steps = Connection(steps_w, readable=False)
        self.replies = Connection(replies_r, writable=False)
        assert self.proc.stderr is not None
        self._stderr = _StderrTail(self.proc.stderr, f"pdserve-tp-rank{self.rank}-stderr")
        try:
            self.steps.send_bytes(launch.encode())
        except OSError:
            pass  # it already exited: the start-up wait reports it with its stderr

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def start_error(self, what: str, *, exited: bool) -> RankStartError:
        """``RankStartError`` for this rank: ``what`` happened; quotes its stderr's end
        (once an ``exited`` rank is reaped and its stderr drained, up to 2 s each)."""
        if exited:
            self.join(2.0)
        tail = self._stderr.text(wait_s=2.0 if exited else 0.0)
        code = self.proc.poll()
        status = f"exit code {code}" if code is not None else "still running"
        return RankStartError(f"tensor-parallel rank {self.rank} {what} ({status}); "
                              f"its stderr ends with:\n{tail or '(nothing)'}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` for the rank to exit (after SHUTDOWN or EOF), then
        kill it; closes the pipes."""
        for conn in (self.steps, self.replies):
            try:
                conn.close()
            except OSError:
                pass
        self.join(timeout_s)
        if self.proc.poll() is None:
            self.proc.kill()
            self.join(5.0)


def await_statuses(ranks: Sequence[RankProcess], kind: StatusKind, timeout_s: float,
                   stage: str) -> list[int]:
    """Each rank's ``kind`` status value, in rank order. Raises ``RankStartError`` as
    soon as a rank exits, sends something else, or ``timeout_s`` passes; ``stage``
    (e.g. "before joining the group") says where in the start-up that was."""
    deadline = time.monotonic() + timeout_s
    values: dict[int, int] = {}
    by_conn = {id(r.replies): r for r in ranks}
    while len(values) < len(ranks):
        pending = [r for r in ranks if r.rank not in values]
        for conn in wait([r.replies for r in pending], _POLL_S):
            rank = by_conn[id(conn)]
            values[rank.rank] = _read_status(rank, kind, stage)
        for rank in pending:
            if rank.rank not in values and not rank.is_alive():
                raise rank.start_error(f"exited during start-up, {stage}", exited=True)
        if time.monotonic() > deadline and len(values) < len(ranks):
            late = [r for r in ranks if r.rank not in values][0]
            raise late.start_error(f"sent no {kind.name} within {timeout_s:.0f}s, {stage}",
                                   exited=False)
    return [values[r.rank] for r in ranks]


def _read_status(rank: RankProcess, kind: StatusKind, stage: str) -> int:
    try:
        status = RankStatus.decode(rank.replies.recv_bytes())
    except (EOFError, OSError):
        raise rank.start_error(f"exited during start-up, {stage}", exited=True) from None
    except ValueError as exc:
        raise rank.start_error(f"sent a malformed status ({exc})", exited=False) from None
    if status.kind is not kind or status.rank != rank.rank:
        raise rank.start_error(f"sent {status} while the leader waited for {kind.name}",
                               exited=False)
    return status.value


def run_watching(ranks: Sequence[RankProcess], fn: Callable[[], _T], stage: str) -> _T:
    """``fn()`` (a blocking call that needs every rank, such as the group rendezvous),
    on a helper thread while this one watches the ranks: a rank that exits meanwhile
    raises ``RankStartError`` at once. ``fn`` is then left to fail on its own timeout
    (the thread is a daemon; what it builds is dropped)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised on the calling thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="pdserve-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_POLL_S)
        for rank in ranks:
            if not rank.is_alive():
                raise rank.start_error(f"exited during start-up, {stage}", exited=True)
    if "error" in result:
        raise result["error"]
    value: _T = result["value"]
    return value
