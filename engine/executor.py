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
from engine.config import EngineConfig
from engine.distributed import (
    LOOPBACK,
    Group,
    StoreAddress,
    connect_store,
    create_store_server,
    make_group,
)
from engine.messages import Op, StepMessage, step_message
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

    ``execute(chunks, layer_hook)`` → logits ``[num sampling chunks, vocab]`` (rows in
    ``chunks`` order). ``layer_hook`` runs on the leader only, after each layer's KV is
    written; an exception it raises is re-raised after the step, so all ranks stay in
    step. ``shutdown()`` stops every rank; idempotent.
    """

    num_kv_blocks: int

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None
                ) -> torch.Tensor: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """A single rank in this process."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.runner = ModelRunner(config, Group.single(), num_kv_blocks)
        self.rank_num_parameters = [self.runner.num_parameters]

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None
                ) -> torch.Tensor:
        return self.runner.execute(chunks, layer_hook)

    def shutdown(self) -> None:
        pass


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
            conn.close()

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None
                ) -> torch.Tensor:
        if self._broken is not None:
            raise ExecutorFailed(f"tensor-parallel executor is unusable: {self._broken}")
        try:
            payload = step_message(chunks).encode()
            for conn in self._conns:
                conn.send_bytes(payload)
            return self.runner.execute(chunks, layer_hook)
        except LayerHookError:
            raise  # the step completed on every rank; the group is consistent
        except BaseException as exc:
            # Followers may be inside this step's collectives: break the group so they
            # fail at once instead of pairing with the next step's collectives.
            self._broken = f"a step failed: {exc!r}"
            self.runner.tp.abort()
            self._release_followers()
            raise ExecutorFailed(self._broken) from exc

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
        self._conns, self._procs = [], []
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.tp.destroy()
        self._store = None  # closes the rendezvous store's listening socket


def _threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def follower_main(config: EngineConfig, rank: int, address: StoreAddress, num_kv_blocks: int,
                  threads: int, steps: Connection, ready: Connection, parent_pid: int) -> None:
    """Entry point of a follower rank: execute every step the leader sends until told to
    stop or the leader goes away (its pipe closes, or a collective fails)."""
    _watch_parent(parent_pid)
    torch.set_num_threads(threads)
    if torch.device(config.device).type == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank: NCCL refuses two ranks on one
    size = config.parallel.tensor_parallel_size
    timeout = config.parallel.collective_timeout_s
    store = connect_store(address, timeout_s=timeout)
    tp = make_group(store, TP_GROUP_PREFIX, rank, size, device=config.device, timeout_s=timeout)
    runner = ModelRunner(config, tp, num_kv_blocks)
    ready.send_bytes(_READY.pack(rank, runner.num_parameters))
    ready.close()
    while True:
        try:
            msg = StepMessage.decode(steps.recv_bytes())
        except EOFError:
            break
        if msg.op is Op.SHUTDOWN:
            break
        runner.execute(msg.chunks)
    tp.destroy()


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
