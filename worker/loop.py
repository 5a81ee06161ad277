"""The engine-loop thread of a worker process and what crosses into it, torch-free.

Threading model of a worker: one ``EngineLoop`` thread owns the engine (``EngineCore`` is
not thread-safe). The gRPC side is one asyncio event loop (``grpc.aio``); its handlers
never touch the engine: they send typed commands through ``EngineLoop.acall`` (a
thread-safe queue; the reply comes back through a ``Future``; ``call`` for other
threads, ``post`` when no reply is wanted) and await their request's results on an
``OutputStream`` that only the loop writes. No handler ever blocks a thread, so no number
of open streams can starve health, ``Abort``, ``Info`` or ``Reserve``. The commands every worker kind answers the same way (``Abort``, ``AbortAll``,
``Info``, ``worker.commands``) are handled here; each kind adds its own
(``prefill_worker.engine_loop``, ``decode_worker.engine_loop``). The loop holds the
worker's KV data plane (``worker.kv.plane.KVPlane``), both directions. The gRPC side of a
worker (ready file, health, registration, signals) is ``worker.server``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from cluster import pause_points
from worker.commands import Abort, AbortAll, Command, Info, LoopInfo, SetRole, WorkerError
from worker.figures import LoopFigures
from worker.leases import LeaseBook
from worker.metrics import RequestTimings, WorkerMetrics
from worker.roles import RoleState

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore, RequestOutput
    from worker.kv.plane import KVPlane
    from worker.kv_events import KVEventPublisher

log = logging.getLogger(__name__)

T = TypeVar("T")
IDLE_POLL_S = 0.001  # how often the loop re-checks KV transfers when it has nothing to step


@dataclass(frozen=True)
class _Queued:
    command: Command[Any]
    future: Future[Any]
    deadline: float | None  # monotonic: the caller's; a command picked up later never runs


class EngineLoop(RoleState):
    """A thread that owns an engine: runs commands between steps, steps while there is
    work, and sleeps on its command queue otherwise.

    ``Abort``, ``AbortAll`` and ``Info`` are answered here for every kind; subclasses
    implement ``_handle_own(command)`` for their own commands (runs on the loop thread; its
    return value or exception goes to the caller), ``_abort(attempt_id, code, reason)``
    (stop one request wherever it is; False if unknown), ``_live_ids()`` (the requests it
    holds), ``_deliver(output)`` (one step output), and may override ``_is_polling()``
    (waiting on something outside the engine, e.g. a KV transfer: ``_poll()`` runs every
    ``IDLE_POLL_S`` and after each round of commands) and ``_num_unadmitted()``. When the
    loop stops (asked to, or dead of an error) every live request is aborted and the
    engine shut down, once, on the loop thread.

    The hooks are cooperative: each kind handles its own requests and passes the rest on
    (``super()``; the defaults know nothing), so one loop may serve both roles
    (``role_worker``; ``worker.roles`` keeps the role it takes new work for).
    """

    def __init__(self, name: str, core: EngineCore, kv: KVPlane, metrics: WorkerMetrics,
                 role: str = "") -> None:
        RoleState.__init__(self, role)
        self.core = core
        self.kv = kv
        self.metrics = metrics
        self.timings = RequestTimings(metrics)
        self.figures = LoopFigures(core, kv, metrics)
        self._commands: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self.error: BaseException | None = None  # why the loop died, if it did
        self.progress_at = time.monotonic()  # the last step, or the last moment idle
        self.num_expired = 0  # requests dropped at their deadline before any compute
        self.num_expired_commands = 0  # commands whose caller's deadline passed unrun
        self.leases = LeaseBook()  # what the lease watcher watches (worker.leases)
        self.kv_events: KVEventPublisher | None = None  # its KV events (worker.process)
        self._client_ids: dict[str, str] = {}  # attempt id -> the client's request id (logs)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def call(self, command: Command[T], timeout_s: float | None = None) -> T:
        """Run ``command`` on the loop thread and return its reply (or raise its error),
        blocking this thread. ``WorkerError(UNAVAILABLE)`` when the loop is not running or
        does not answer in ``timeout_s``. A command not started within ``timeout_s`` never
        runs: the loop drops a command it picks up after its caller's deadline."""
        future = self._enqueue(command, timeout_s)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                              f"engine loop did not answer {type(command).__name__}") from None

    async def acall(self, command: Command[T], timeout_s: float | None = None) -> T:
        """``call`` for the gRPC side's event loop: awaits the reply, blocks nothing.
        Give the RPC's remaining time (``call_timeout``): a command whose caller left is
        never run later."""
        future = self._enqueue(command, timeout_s)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            future.cancel()
            raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                              f"engine loop did not answer {type(command).__name__}") from None

    def post(self, command: Command[Any]) -> None:
        """Queue ``command`` without waiting for its reply (errors are logged); nothing
        when the loop is not running (it released everything when it stopped)."""
        try:
            future = self._enqueue(command)
        except WorkerError:
            return
        future.add_done_callback(_log_failure)

    def stalled_s(self) -> float:
        """Seconds the loop has had work but completed no step (0 when it makes progress)."""
        if not self.core.has_unfinished():
            return 0.0
        return time.monotonic() - self.progress_at

    def _enqueue(self, command: Command[T], timeout_s: float | None = None) -> Future[T]:
        if not self.alive:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, "the engine loop is not running")
        future: Future[T] = Future()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._commands.put(_Queued(command, future, deadline))
        return future

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
                    self._before_step()
                    for out in self.figures.step(self.role == "prefill"):
                        self._deliver(out)
                    self._after_step()
                self.progress_at = time.monotonic()
                self._refresh_metrics()
        except BaseException as exc:  # the loop is dead: health turns NOT_SERVING
            log.exception("engine loop failed")
            self.error = exc
        finally:
            self._stopped.set()
            _fail_queued(self._commands)
            self._close()

    def _serve_commands(self) -> bool:
        """Run queued commands (block for one when idle), then ``_poll`` if polling.
        False once asked to stop. Work the last step could schedule none of (blocks held
        for KV on its way, say) waits as an idle loop does, not in a spin of empty steps
        (each polling every rank)."""
        busy = self.core.has_unfinished()
        stuck = busy and not self.core.last_step_chunks
        block = stuck or not busy
        timeout = IDLE_POLL_S if self._is_polling() or stuck else None
        while True:
            try:
                item = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                break
            if item is None:
                return False
            block = False
            if not isinstance(item.command, Info):  # Info reads; the others may change figures
                self.figures.settled = False  # the snapshot is taken again once idle
            if not item.future.set_running_or_notify_cancel():
                continue
            if item.deadline is not None and time.monotonic() > item.deadline:
                self.num_expired_commands += 1  # its caller has left: never run it
                item.future.set_exception(WorkerError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{type(item.command).__name__} not started before its caller's deadline"))
                continue
            if pause_points.enabled():
                pause_points.pause("worker.command", command=type(item.command).__name__,
                                   attempt_id=str(getattr(item.command, "attempt_id", "")))
            try:
                item.future.set_result(self._handle(item.command))
            except Exception as exc:
                item.future.set_exception(exc)
        if self._is_polling():
            self._poll()
        return True

    def _close(self) -> None:
        """Fail every request still held (UNAVAILABLE: the caller may retry elsewhere) and
        shut the engine down. Each abort on its own: when ranks are dead an abort that
        calls into them raises, and every later request must still be failed at once."""
        reason = ("the worker is shutting down" if self.error is None
                  else f"the engine loop stopped: {self.error!r}")
        try:
            for rid in self._live_ids():
                try:
                    self._abort(rid, grpc.StatusCode.UNAVAILABLE, reason)
                except Exception:
                    log.warning("abort while closing failed (its caller was failed first)",
                                exc_info=True, extra=self.log_extra(rid))
        finally:
            self.core.shutdown()

    def _refresh_metrics(self) -> None:
        """The metrics' snapshot, every ``figures.SNAPSHOT_S`` and once the loop goes idle
        (the loop thread)."""
        idle = not self.core.has_unfinished() and not self._is_polling()
        if self.figures.due(idle):
            self._forget_ended()
            self.figures.refresh(self._num_unadmitted(), idle)

    # --- the commands every kind shares -------------------------------------------
    def _handle(self, command: Command[Any]) -> Any:
        if isinstance(command, Abort):
            return self._abort(command.attempt_id, grpc.StatusCode.ABORTED, command.reason)
        if isinstance(command, AbortAll):
            ids = self._live_ids()
            for rid in ids:
                self._abort(rid, grpc.StatusCode.UNAVAILABLE, command.reason)
            return len(ids)
        if isinstance(command, Info):
            return self._info()
        if isinstance(command, SetRole):
            return self.set_role(command.role)
        return self._handle_own(command)

    def named(self, attempt_id: str, client_request_id: str) -> None:
        """Log lines about ``attempt_id`` name the client's request id too (loop thread)."""
        if client_request_id and client_request_id != attempt_id:
            self._client_ids[attempt_id] = client_request_id

    def log_extra(self, attempt_id: str) -> dict[str, str]:
        """``extra`` of a log line about an attempt: ``request_id=<client id> attempt=<id>``."""
        client = self._client_ids.get(attempt_id)
        return {"request_id": attempt_id if client is None
                else f"{client} attempt={attempt_id}"}

    def _forget_ended(self) -> None:
        """Drop what is kept per attempt for attempts no longer held."""
        live = set(self._live_ids())
        self.leases.retain(live)  # attempts that ended here by themselves
        for attempt_id in set(self._client_ids) - live:
            del self._client_ids[attempt_id]

    def _info(self) -> LoopInfo:
        self._forget_ended()
        return self.figures.info(live_ids=self._live_ids(), num_unadmitted=self._num_unadmitted(),
                                 num_expired=self.num_expired,
                                 num_expired_commands=self.num_expired_commands,
                                 queued_commands=self._commands.qsize(), leases=self.leases)

    # --- what each kind implements (cooperatively: the defaults know nothing) ----------
    def _handle_own(self, command: Command[Any]) -> Any:
        raise TypeError(f"unknown command {command!r}")

    def _abort(self, attempt_id: str, code: grpc.StatusCode, reason: str) -> bool:
        """Stop one request wherever it is: fail its caller's stream first, then release
        what it holds (which may call into the ranks and raise); False if unknown."""
        return False

    def _live_ids(self) -> list[str]:
        return []

    def _deliver(self, out: RequestOutput) -> None:
        """One step output of a request no kind holds (the warm-up's)."""

    def _is_polling(self) -> bool:
        return False

    def _poll(self) -> None:
        """Check on what the loop waits for outside the engine (e.g. KV transfers)."""

    def _num_unadmitted(self) -> int:
        """Requests this worker holds that the scheduler does not count as waiting yet."""
        return 0

    def _before_step(self) -> None:
        """Runs before each step (e.g. drop requests whose deadline passed)."""

    def _after_step(self) -> None:
        """Runs after each step, once its outputs were delivered."""


def _fail_queued(commands: queue.SimpleQueue[_Queued | None]) -> None:
    """Fail every command still queued: the loop stopped."""
    while True:
        try:
            item = commands.get_nowait()
        except queue.Empty:
            return
        if item is not None and item.future.set_running_or_notify_cancel():
            item.future.set_exception(
                WorkerError(grpc.StatusCode.UNAVAILABLE, "the engine loop stopped"))


def _log_failure(future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a posted engine-loop command failed: %s", future.exception())
