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
from engine.runner import ModelRunner
from engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

TP_GROUP_PREFIX = "tp/"
# follower -> leader once loaded: (rank, number of parameter elements it holds)
_READY = struct.Struct("<qq")


class Executor(Protocol):
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
        size = config.parallel.tensor_parallel_size
        threads = _threads_per_rank(size)
        torch.set_num_threads(threads)
        timeout = config.parallel.collective_timeout_s
        self._store = create_store_server(LOOPBACK, 0, timeout_s=timeout)
        address = StoreAddress(LOOPBACK, self._store.port)
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
            tp = make_group(self._store, TP_GROUP_PREFIX, 0, size, device=config.device, timeout_s=timeout)
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
        payload = step_message(chunks).encode()
        for conn in self._conns:
            conn.send_bytes(payload)
        return self.runner.execute(chunks, layer_hook)

    def shutdown(self) -> None:
        """Stop the followers (politely, then by force); idempotent."""
        bye = StepMessage(Op.SHUTDOWN).encode()
        for conn in self._conns:
            try:
                conn.send_bytes(bye)
                conn.close()
            except OSError:
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


def _threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def follower_main(config: EngineConfig, rank: int, address: StoreAddress, num_kv_blocks: int,
                  threads: int, steps: Connection, ready: Connection, parent_pid: int) -> None:
    """Entry point of a follower rank: execute every step the leader sends until told to
    stop or the leader goes away (its pipe closes, or a collective fails)."""
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
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


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux), and stop at once
    if the parent is already gone."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        log.debug("PR_SET_PDEATHSIG unavailable; relying on the step pipe closing")
    if os.getppid() != parent_pid:
        os._exit(1)
