"""The engine-loop thread of a worker process and what crosses into it, torch-free.

Threading model of a worker: one ``EngineLoop`` thread owns the engine (``EngineCore`` is
not thread-safe). gRPC handler threads never touch the engine; they send typed commands
through ``EngineLoop.call`` (a thread-safe queue; the reply comes back through a
``Future``) and read their request's results from an ``OutputStream`` that only the loop
writes. The commands every worker kind answers the same way (``Abort``, ``AbortAll``,
``Info``) are handled here; each kind adds its own (``prefill_worker.engine_loop``,
``decode_worker.engine_loop``). The gRPC side of a worker (ready file, health,
registration, signals) is ``worker.server``.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import grpc

from engine.kvcache import KVCacheUsage

if TYPE_CHECKING:
    from engine.core import EngineCore, RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")
IDLE_POLL_S = 0.005  # how often the loop re-checks KV transfers when it has nothing to step


class WorkerError(Exception):
    """A failure reported to a gRPC caller: ``code`` is the status, ``message`` its text."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


CALL_TIMEOUT_S = 30.0  # a command the loop does not answer in this long: UNAVAILABLE


@dataclass(frozen=True)
class Command(Generic[T]):
    """Base of the typed commands a loop accepts; ``T`` is the reply type."""


@dataclass(frozen=True)
class Abort(Command[bool]):
    """Stop a request wherever it is and release what it holds; False if unknown."""

    request_id: str
    reason: str = "aborted"


@dataclass(frozen=True)
class AbortAll(Command[int]):
    reason: str = "the worker is shutting down"


@dataclass(frozen=True)
class Info(Command["LoopInfo"]):
    pass


@dataclass(frozen=True)
class LoopInfo:
    """A worker's state for ``Info`` and the leak checks."""

    kv: KVCacheUsage
    pending_transfers: int  # the leader's open handoffs + every rank's pending transfers
    open_kv_channels: int  # summed over ranks
    running: int
    waiting: int
    num_preemptions: int = 0  # since the worker started


class KVLeader(Protocol):
    """What the loop asks a worker kind's KV leader (``*_worker.kv_leader``) for ``Info``."""

    @property
    def num_pending(self) -> int: ...

    def rank_totals(self) -> tuple[int, int]:
        """(pending transfers, open KV channels), summed over the ranks."""
        ...


class EngineLoop:
    """A thread that owns an engine: runs commands between steps, steps while there is
    work, and sleeps on its command queue otherwise.

    ``Abort``, ``AbortAll`` and ``Info`` are answered here for every kind; subclasses
    implement ``_handle_own(command)`` for their own commands (runs on the loop thread; its
    return value or exception goes to the caller), ``_abort(request_id, code, reason)``
    (stop one request wherever it is; False if unknown), ``_live_ids()`` (the requests it
    holds), ``_deliver(output)`` (one step output), and may override ``_is_polling()``
    (waiting on something outside the engine, e.g. a KV transfer: ``_poll()`` runs every
    ``IDLE_POLL_S`` and after each round of commands) and ``_num_unadmitted()``. When the
    loop stops (asked to, or dead of an error) every live request is aborted and the
    engine shut down, once, on the loop thread.
    """

    def __init__(self, name: str, core: EngineCore, kv_leader: KVLeader) -> None:
        self.core = core
        self.kv_leader = kv_leader
        self._commands: queue.SimpleQueue[tuple[Command[Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self.error: BaseException | None = None  # why the loop died, if it did

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def call(self, command: Command[T], timeout_s: float | None = None) -> T:
        """Run ``command`` on the loop thread and return its reply (or raise its error).
        ``WorkerError(UNAVAILABLE)`` when the loop is not running or does not answer in
        ``timeout_s``."""
        if not self.alive:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, "the engine loop is not running")
        future: Future[T] = Future()
        self._commands.put((command, future))
        try:
            return future.result(timeout_s)
        except TimeoutError:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                              f"engine loop did not answer {type(command).__name__}") from None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the loop to close (abort everything, shut the engine down) and wait."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout_s)

    # --- the thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._serve_commands():
                if self.core.has_unfinished():
                    for out in self.core.step():
                        self._deliver(out)
        except BaseException as exc:  # the loop is dead: health turns NOT_SERVING
            log.exception("engine loop failed")
            self.error = exc
        finally:
            self._stopped.set()
            self._fail_queued()
            self._close()

    def _serve_commands(self) -> bool:
        """Run queued commands (block for one when idle), then ``_poll`` if polling.
        False once asked to stop."""
        block = not self.core.has_unfinished()
        timeout = IDLE_POLL_S if self._is_polling() else None
        while True:
            try:
                item = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            if item is None:
                return False
            command, future = item
            block = False
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._handle(command))
            except Exception as exc:
                future.set_exception(exc)
        if self._is_polling():
            self._poll()
        return True

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(
                    WorkerError(grpc.StatusCode.UNAVAILABLE, "the engine loop stopped"))

    def _close(self) -> None:
        try:
            for rid in self._live_ids():
                self._abort(rid, grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        finally:
            self.core.shutdown()

    # --- the commands every kind shares -------------------------------------------
    def _handle(self, command: Command[Any]) -> Any:
        if isinstance(command, Abort):
            return self._abort(command.request_id, grpc.StatusCode.ABORTED, command.reason)
        if isinstance(command, AbortAll):
            ids = self._live_ids()
            for rid in ids:
                self._abort(rid, grpc.StatusCode.UNAVAILABLE, command.reason)
            return len(ids)
        if isinstance(command, Info):
            return self._info()
        return self._handle_own(command)

    def _info(self) -> LoopInfo:
        pending, channels = self.kv_leader.rank_totals()
        sched = self.core.scheduler
        return LoopInfo(
            kv=self.core.kv_usage(), pending_transfers=self.kv_leader.num_pending + pending,
            open_kv_channels=channels, running=len(sched.running),
            waiting=len(sched.waiting) + self._num_unadmitted(),
            num_preemptions=sched.stats.num_preemptions)

    # --- what each kind implements --------------------------------------------------
    def _handle_own(self, command: Command[Any]) -> Any:
        raise TypeError(f"unknown command {command!r}")

    def _abort(self, request_id: str, code: grpc.StatusCode, reason: str) -> bool:
        raise NotImplementedError

    def _live_ids(self) -> list[str]:
        raise NotImplementedError

    def _deliver(self, out: RequestOutput) -> None:
        raise NotImplementedError

    def _is_polling(self) -> bool:
        return False

    def _poll(self) -> None:
        """Check on what the loop waits for outside the engine (e.g. KV transfers)."""

    def _num_unadmitted(self) -> int:
        """Requests this worker holds that the scheduler does not count as waiting yet."""
        return 0


class OutputStream(Generic[T]):
    """One request's results, written by the loop thread, read by one handler thread.

    Bounded by construction: the loop puts at most ``capacity`` items (one per token plus
    the end), so ``put`` never blocks the loop; a put beyond it is a bug and raises.
    The end of the stream is an item for which the reader's own check says so, or a
    ``WorkerError`` (put with ``fail``).
    """

    def __init__(self, capacity: int) -> None:
        self._queue: queue.Queue[T | WorkerError] = queue.Queue(maxsize=capacity)

    def put(self, item: T) -> None:
        self._queue.put_nowait(item)

    def fail(self, code: grpc.StatusCode, message: str) -> None:
        try:
            self._queue.put_nowait(WorkerError(code, message))
        except queue.Full:  # the reader has not drained; an error replaces the last item
            self._queue.get_nowait()
            self._queue.put_nowait(WorkerError(code, message))

    def get(self, timeout_s: float | None) -> T:
        """The next item; raises the ``WorkerError`` put by ``fail``, or
        ``WorkerError(DEADLINE_EXCEEDED)`` after ``timeout_s``."""
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        if isinstance(item, WorkerError):
            raise item
        return item
