"""Executors run a step on every rank of one engine.

``LocalExecutor``: one rank, in this process. ``TPExecutor``: rank 0 (the leader) runs
in this process; ranks 1..t-1 are programs of their own (``python -m engine.tp.rank_main``,
started by ``engine.tp.rank_process``) that die with their parent. For each step the
leader sends a ``StepMessage`` (ids and counts) to every follower over a pipe, then all
ranks run the same forward, meeting in the TP group's collectives.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.attention.metadata import LayerHook
from engine.config import EngineConfig
from engine.core.runner import LayerHookError, ModelRunner
from engine.core.scheduler import ScheduledChunk
from engine.kernels.choice import choose_kernel_plan
from engine.kernels.linear import KernelPlan
from engine.tp.distributed import LOOPBACK, Group, create_store_server, make_group
from engine.tp.messages import Op, StepMessage, step_message
from engine.tp.rank_plugin import RankContext, RankPlugin, load_rank_plugin, run_call, unframe_reply
from engine.tp.rank_process import RankLaunch, RankProcess, StatusKind, await_statuses, run_watching


class ExecutorFailed(RuntimeError):
    """A step failed part-way on a tensor-parallel executor: its group was torn down and
    the executor (and the engine on it) cannot run further steps."""


TP_GROUP_PREFIX = "tp/"


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


def make_plugin(config: EngineConfig, runner: ModelRunner) -> RankPlugin | None:
    if config.rank_plugin is None:
        return None
    ctx = RankContext(runner.tp.rank, runner.tp.size, config, runner.kv_cache, runner.kernel_plan)
    return load_rank_plugin(config.rank_plugin, ctx)


def plugin_hook(plugin: RankPlugin | None, chunks: Sequence[ScheduledChunk],
                 payload: bytes) -> LayerHook | None:
    return plugin.step_hook(chunks, payload) if plugin is not None else None


def require_plugin(plugin: RankPlugin | None) -> RankPlugin:
    if plugin is None:
        raise RuntimeError("this engine has no rank_plugin to call")
    return plugin


class LocalExecutor:
    """A single rank in this process."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.kernel_plan, self.kernel_choice_s = _choose_kernels(config, torch.get_num_threads())
        self.runner = ModelRunner(config, Group.single(), num_kv_blocks, self.kernel_plan)
        self.rank_num_parameters = [self.runner.num_parameters]
        self.plugin = make_plugin(config, self.runner)

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None,
                payload: bytes = b"") -> torch.Tensor:
        return self.runner.execute(chunks, _chain(layer_hook, plugin_hook(self.plugin, chunks, payload)))

    def call(self, request: bytes) -> list[bytes]:
        return [unframe_reply(0, run_call(require_plugin(self.plugin), request))]

    def shutdown(self) -> None:
        plugin, self.plugin = self.plugin, None
        if plugin is not None:
            plugin.close()


class TPExecutor:
    """``tensor_parallel_size`` ranks: the leader here, followers as processes of their
    own (``engine.tp.rank_process``) that die with this one.

    Start-up: start the followers → each says HELLO → the group rendezvous (watched) →
    the leader loads its shard → each follower says READY. A follower that exits or does
    not answer within ``startup_timeout_s`` raises ``RankStartError`` with the end of its
    stderr, and every rank is stopped.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, *,
                 startup_timeout_s: float = 300.0) -> None:
        self.num_kv_blocks = num_kv_blocks
        self._broken: str | None = None
        self._ranks: list[RankProcess] = []
        size = config.parallel.tensor_parallel_size
        threads = _threads_per_rank(size)
        torch.set_num_threads(threads)
        timeout = config.parallel.collective_timeout_s
        # chosen before the ranks start, so they do not share the cores with the timing
        self.kernel_plan, self.kernel_choice_s = _choose_kernels(config, threads)
        store = create_store_server(LOOPBACK, 0, timeout_s=timeout)
        self._store: object | None = store
        try:
            for rank in range(1, size):
                self._ranks.append(RankProcess(RankLaunch(
                    rank=rank, config=config, store_host=LOOPBACK, store_port=store.port,
                    num_kv_blocks=num_kv_blocks, threads=threads, parent_pid=os.getpid(),
                    kernel_plan=self.kernel_plan, sys_path=tuple(p for p in sys.path if p))))
            await_statuses(self._ranks, StatusKind.HELLO, startup_timeout_s,
                           "before joining the tensor-parallel group")
            tp = run_watching(self._ranks, lambda: make_group(
                store, TP_GROUP_PREFIX, 0, size, device=config.device, timeout_s=timeout),
                "while joining the tensor-parallel group")
            self.runner = ModelRunner(config, tp, num_kv_blocks, self.kernel_plan)
            self.plugin = make_plugin(config, self.runner)
            loaded = await_statuses(self._ranks, StatusKind.READY, startup_timeout_s,
                                    "before it was ready to run steps")
            self.rank_num_parameters = [self.runner.num_parameters, *loaded]
        except BaseException:
            self.shutdown()
            raise

    @property
    def follower_pids(self) -> list[int]:
        """Process ids of ranks 1..t-1."""
        return [r.pid for r in self._ranks]

    def execute(self, chunks: Sequence[ScheduledChunk], layer_hook: LayerHook | None = None,
                payload: bytes = b"") -> torch.Tensor:
        self._check_usable()
        try:
            message = step_message(chunks, payload).encode()
            for rank in self._ranks:
                rank.steps.send_bytes(message)
            hook = _chain(layer_hook, plugin_hook(self.plugin, chunks, payload))
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
        plugin = require_plugin(self.plugin)
        message = StepMessage(Op.CALL, payload=request).encode()
        try:
            for rank in self._ranks:
                rank.steps.send_bytes(message)
            framed = [run_call(plugin, request)]
            for rank in self._ranks:
                if not rank.replies.poll(timeout_s):
                    raise TimeoutError(
                        f"rank {rank.rank} did not answer a plugin call in {timeout_s}s")
                framed.append(rank.replies.recv_bytes())
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
        for rank in self._ranks:
            try:
                rank.steps.close()
            except OSError:
                pass

    def shutdown(self) -> None:
        """Stop the followers (politely, then by force); idempotent."""
        if self._broken is None:
            self._broken = "shut down"
        bye = StepMessage(Op.SHUTDOWN).encode()
        for rank in self._ranks:
            try:
                rank.steps.send_bytes(bye)
            except (OSError, ValueError):  # already closed or broken
                pass
        for rank in self._ranks:
            rank.stop()
        self._ranks = []
        plugin, self.plugin = getattr(self, "plugin", None), None
        if plugin is not None:
            plugin.close()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.tp.destroy()
        self._store = None  # closes the rendezvous store's listening socket


def _choose_kernels(config: EngineConfig, threads: int) -> tuple[KernelPlan, float]:
    """The leader's kernel plan for every rank, and the seconds choosing it took."""
    start = time.perf_counter()
    plan = choose_kernel_plan(config, threads)
    return plan, time.perf_counter() - start


def _threads_per_rank(size: int) -> int:
    """``OMP_NUM_THREADS`` when set (a launcher sharing the cores between several workers
    decides), else the machine's cores split evenly between the ``size`` ranks."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, (os.cpu_count() or 1) // size)
