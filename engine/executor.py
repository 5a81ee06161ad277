"""Executors run a step on every rank of one engine.

``LocalExecutor``: one rank, in this process. ``TPExecutor``: rank 0 (the leader) runs
in this process; ranks 1..t-1 are spawned processes that die with their parent. For
each step the leader sends a ``StepMessage`` (ids and counts) to every follower over a
pipe, then all ranks run the same forward, meeting in the TP group's collectives.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import struct
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Protocol

import torch

from engine.attention.metadata import LayerHook
from engine.config import EngineConfig, rank_visible_gpu
from engine.distributed import (
    LOOPBACK,
    Group,
    StoreAddress,
    connect_store,
    create_store_server,
    make_group,
)
from engine.messages import Op, StepMessage, step_message
from engine.rank_plugin import RankContext, RankPlugin, load_rank_plugin, run_call, unframe_reply
from engine.runner import LayerHookError, ModelRunner
from engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


class ExecutorFailed(RuntimeError):
    """A step failed part-way on a tensor-parallel executor: its group was torn down and
    the executor (and the engine on it) cannot run further steps."""

TP_GROUP_PREFIX = "tp/"
# follower -> leader once loaded: (rank, number of parameter elements it holds)
_READY = struct.Struct("<qq")


class Executor(Protocol):
    """Runs one step on every rank of an engine and returns the leader's logits.

    ``execute(chunks, layer_hook, payload)`` → logits ``[num sampling chunks, vocab]``
    (rows in ``chunks`` order). ``layer_hook`` runs on the leader only, after each
    layer's KV is written; an exception it raises is re-raised after the step, so all
    ranks stay in step. ``payload`` goes to every rank's plugin ``step_hook``.
    ``call(request)`` asks every rank's plugin (rank order). ``shutdown()`` stops every
    rank; idempotent.
    """

    num_kv_blocks: int

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None,
                payload: bytes = b"") -> torch.Tensor: ...

    def call(self, request: bytes) -> list[bytes]: ...

    def shutdown(self) -> None: ...


def _chain(*hooks: LayerHook | None) -> LayerHook | None:
    present = [h for h in hooks if h is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def run_all(layer_idx: int) -> None:
        for hook in present:
            hook(layer_idx)

    return run_all


def _make_plugin(config: EngineConfig, runner: ModelRunner) -> RankPlugin | None:
    if config.rank_plugin is None:
        return None
    ctx = RankContext(runner.tp.rank, runner.tp.size, config, runner.kv_cache)
    return load_rank_plugin(config.rank_plugin, ctx)


def _plugin_hook(plugin: RankPlugin | None, chunks: Sequence[ScheduledChunk],
                 payload: bytes) -> LayerHook | None:
    return plugin.step_hook(chunks, payload) if plugin is not None else None


def _require_plugin(plugin: RankPlugin | None) -> RankPlugin:
    if plugin is None:
        raise RuntimeError("this engine has no rank_plugin to call")
    return plugin


class LocalExecutor:
    """A single rank in this process."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.runner = ModelRunner(config, Group.single(), num_kv_blocks)
        self.rank_num_parameters = [self.runner.num_parameters]
        self.plugin = _make_plugin(config, self.runner)

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None,
                payload: bytes = b"") -> torch.Tensor:
        return self.runner.execute(chunks, _chain(layer_hook, _plugin_hook(self.plugin, chunks, payload)))

    def call(self, request: bytes) -> list[bytes]:
        return [unframe_reply(0, run_call(_require_plugin(self.plugin), request))]

    def shutdown(self) -> None:
        plugin, self.plugin = self.plugin, None
        if plugin is not None:
            plugin.close()


class TPExecutor:
    """``tensor_parallel_size`` ranks: the leader here, followers as spawned processes."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, *,
                 startup_timeout_s: float = 300.0) -> None:
        self.num_kv_blocks = num_kv_blocks
        self._broken: str | None = None
        size = config.parallel.tensor_parallel_size
        threads = _threads_per_rank(size)
        torch.set_num_threads(threads)
        timeout = config.parallel.collective_timeout_s
        store = create_store_server(LOOPBACK, 0, timeout_s=timeout)
        self._store: object | None = store
        address = StoreAddress(LOOPBACK, store.port)
        ctx = mp.get_context("spawn")
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        ready: list[Connection] = []
        for rank in range(1, size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            ready_recv, ready_send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=follower_main, name=f"pdserve-tp-rank{rank}", daemon=True,
                args=(config, rank, address, num_kv_blocks, threads, recv_end, ready_send, os.getpid()),
            )
            proc.start()
            recv_end.close()
            ready_send.close()
            self._procs.append(proc)
            self._conns.append(send_end)
            ready.append(ready_recv)
        try:
            tp = make_group(store, TP_GROUP_PREFIX, 0, size, device=config.device, timeout_s=timeout)
            self.runner = ModelRunner(config, tp, num_kv_blocks)
            self.plugin = _make_plugin(config, self.runner)
            self._replies = ready  # followers answer plugin calls on their ready pipe
            self._await_ready(ready, startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _await_ready(self, ready: list[Connection], timeout_s: float) -> None:
        """Wait for every follower's ready message; records how many parameters each holds."""
        self.rank_num_parameters = [self.runner.num_parameters]
        for rank, (conn, proc) in enumerate(zip(ready, self._procs, strict=True), start=1):
            try:
                got = conn.recv_bytes() if conn.poll(timeout_s) else b""
            except EOFError:
                got = b""
            if len(got) != _READY.size or _READY.unpack(got)[0] != rank:
                proc.join(timeout=1)
                raise RuntimeError(f"TP rank {rank} did not start (exit code {proc.exitcode})")
            self.rank_num_parameters.append(_READY.unpack(got)[1])

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None,
                payload: bytes = b"") -> torch.Tensor:
        self._check_usable()
        try:
            message = step_message(chunks, payload).encode()
            for conn in self._conns:
                conn.send_bytes(message)
            hook = _chain(layer_hook, _plugin_hook(self.plugin, chunks, payload))
            return self.runner.execute(chunks, hook)
        except LayerHookError:
            raise  # the step completed on every rank; the group is consistent
        except BaseException as exc:
            # Followers may be inside this step's collectives: break the group so they
            # fail at once instead of pairing with the next step's collectives.
            self._broken = f"a step failed: {exc!r}"
            self.runner.tp.abort()
            self._release_followers()
            raise ExecutorFailed(self._broken) from exc

    def call(self, request: bytes, timeout_s: float = 60.0) -> list[bytes]:
        """Every rank's plugin reply to ``request``, in rank order (between steps)."""
        self._check_usable()
        plugin = _require_plugin(self.plugin)
        message = StepMessage(Op.CALL, payload=request).encode()
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            framed = [run_call(plugin, request)]
            for rank, conn in enumerate(self._replies, start=1):
                if not conn.poll(timeout_s):
                    raise TimeoutError(f"rank {rank} did not answer a plugin call in {timeout_s}s")
                framed.append(conn.recv_bytes())
        except (OSError, EOFError, TimeoutError) as exc:
            self._broken = f"a plugin call failed: {exc!r}"
            self.runner.tp.abort()
            self._release_followers()
            raise ExecutorFailed(self._broken) from exc
        return [unframe_reply(rank, reply) for rank, reply in enumerate(framed)]

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ExecutorFailed(f"tensor-parallel executor is unusable: {self._broken}")

    def _release_followers(self) -> None:
        """Close the step pipes: followers waiting for a step see EOF and exit."""
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass

    def shutdown(self) -> None:
        """Stop the followers (politely, then by force); idempotent."""
        if self._broken is None:
            self._broken = "shut down"
        bye = StepMessage(Op.SHUTDOWN).encode()
        for conn in self._conns:
            try:
                conn.send_bytes(bye)
                conn.close()
            except (OSError, ValueError):  # already closed or broken
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in getattr(self, "_replies", []):
            conn.close()
        self._conns, self._procs, self._replies = [], [], []
        plugin, self.plugin = getattr(self, "plugin", None), None
        if plugin is not None:
            plugin.close()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.tp.destroy()
        self._store = None  # closes the rendezvous store's listening socket


def _threads_per_rank(size: int) -> int:
    """``OMP_NUM_THREADS`` when set (a launcher sharing the cores between several workers
    decides), else the machine's cores split evenly between the ``size`` ranks."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, (os.cpu_count() or 1) // size)


def follower_main(config: EngineConfig, rank: int, address: StoreAddress, num_kv_blocks: int,
                  threads: int, steps: Connection, ready: Connection, parent_pid: int) -> None:
    """Entry point of a follower rank: execute every step the leader sends until told to
    stop or the leader goes away (its pipe closes, or a collective fails)."""
    _watch_parent(parent_pid)
    torch.set_num_threads(threads)
    if torch.device(config.device).type == "cuda":
        _bind_gpu(rank)
    size = config.parallel.tensor_parallel_size
    timeout = config.parallel.collective_timeout_s
    store = connect_store(address, timeout_s=timeout)
    tp = make_group(store, TP_GROUP_PREFIX, rank, size, device=config.device, timeout_s=timeout)
    runner = ModelRunner(config, tp, num_kv_blocks)
    plugin = _make_plugin(config, runner)
    ready.send_bytes(_READY.pack(rank, runner.num_parameters))
    try:
        _serve_steps(runner, plugin, steps, replies=ready)
    finally:
        if plugin is not None:
            plugin.close()
        tp.destroy()


def _bind_gpu(rank: int) -> None:
    """One GPU per rank (NCCL refuses two ranks on one): the rank's own under
    ``$PDSERVE_RANK_GPUS`` (then the only one this process sees), else ``cuda:rank``.
    Runs before anything in this process starts CUDA."""
    own = rank_visible_gpu(rank, os.environ)
    if own is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = own
    torch.cuda.set_device(0 if own is not None else rank)


def _serve_steps(runner: ModelRunner, plugin: RankPlugin | None, steps: Connection,
                 replies: Connection) -> None:
    """A follower's loop: run steps and answer plugin calls until SHUTDOWN or EOF."""
    while True:
        try:
            msg = StepMessage.decode(steps.recv_bytes())
        except EOFError:
            return
        if msg.op is Op.SHUTDOWN:
            return
        if msg.op is Op.CALL:
            replies.send_bytes(run_call(_require_plugin(plugin), msg.payload))
            continue
        try:
            runner.execute(msg.chunks, _plugin_hook(plugin, msg.chunks, msg.payload))
        except LayerHookError:
            log.exception("rank %d: a plugin layer hook failed; the step completed", runner.tp.rank)


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this follower soon after its leader process is gone, however it died.

    A watchdog thread, not PR_SET_PDEATHSIG: that signal fires when the *thread* that
    spawned us exits, and engines are often built on short-lived threads. A leader that
    dies mid-step is also noticed at once by the gloo collectives ("connection closed").
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="pdserve-parent-watch", daemon=True).start()
