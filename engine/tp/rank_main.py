"""A follower rank of a tensor-parallel engine: ``python -m engine.tp.rank_main``.

Started by its leader (``engine.tp.rank_process.RankProcess``) with two pipe file
descriptors. It reads a ``RankLaunch``, says HELLO, joins the TP group, builds its model
shard and rank plugin, says READY, then runs every step the leader sends until told to
stop or the leader goes away (its pipe closes, a collective fails, or its process is
gone). Never imports the user's ``__main__``. SIGINT is ignored: a Ctrl-C reaches the
whole process group, and the leader decides when its ranks stop.

Test-only: ``PDSERVE_TEST_RANK_FAULT=start|group|load`` makes the rank raise right after
reading its launch message, after its HELLO instead of joining the group (while the
leader waits in the rendezvous), or just before loading its model, so tests can check
that the leader reports the rank's own error at each stage.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

import torch

from engine.config import rank_visible_gpu
from engine.core.runner import LayerHookError, ModelRunner
from engine.tp.distributed import StoreAddress, connect_store, make_group
from engine.tp.executor import TP_GROUP_PREFIX, make_plugin, plugin_hook, require_plugin
from engine.tp.messages import Op, StepMessage
from engine.tp.rank_plugin import RankPlugin, run_call
from engine.tp.rank_process import RankLaunch, RankStatus, StatusKind

TEST_FAULT_ENV = "PDSERVE_TEST_RANK_FAULT"
TEST_FAULT_STAGES = ("start", "group", "load")

log = logging.getLogger("engine.tp.rank_main")


class InjectedRankFault(RuntimeError):
    """Raised where ``PDSERVE_TEST_RANK_FAULT`` says (tests only)."""


def _maybe_fail(stage: str) -> None:
    wanted = os.environ.get(TEST_FAULT_ENV)
    if wanted is not None and wanted not in TEST_FAULT_STAGES:
        raise InjectedRankFault(f"{TEST_FAULT_ENV}={wanted!r} is not one of {TEST_FAULT_STAGES}")
    if wanted == stage:
        raise InjectedRankFault(f"{TEST_FAULT_ENV}={stage}: this rank was told to fail here")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.tp.rank_main", description=__doc__)
    parser.add_argument("--steps-fd", type=int, required=True)
    parser.add_argument("--replies-fd", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    steps = Connection(args.steps_fd, writable=False)
    replies = Connection(args.replies_fd, readable=False)
    try:
        data = steps.recv_bytes()
    except EOFError:
        return  # the leader went away before it sent the launch message
    launch = RankLaunch.decode(data)
    _watch_parent(launch.parent_pid)
    sys.path.extend(p for p in launch.sys_path if p not in sys.path)
    _maybe_fail("start")
    run_follower(launch, steps, replies)


def run_follower(launch: RankLaunch, steps: Connection, replies: Connection) -> None:
    """Join the group, load this rank's shard and plugin, then serve steps."""
    config, rank = launch.config, launch.rank
    torch.set_num_threads(launch.threads)
    if torch.device(config.device).type == "cuda":
        _bind_gpu(rank)
    size = config.parallel.tensor_parallel_size
    timeout = config.parallel.collective_timeout_s
    store = connect_store(StoreAddress(launch.store_host, launch.store_port), timeout_s=timeout)
    replies.send_bytes(RankStatus(StatusKind.HELLO, rank, os.getpid()).encode())
    _maybe_fail("group")
    tp = make_group(store, TP_GROUP_PREFIX, rank, size, device=config.device, timeout_s=timeout)
    _maybe_fail("load")
    runner = ModelRunner(config, tp, launch.num_kv_blocks, launch.kernel_plan)
    plugin = make_plugin(config, runner)
    replies.send_bytes(RankStatus(StatusKind.READY, rank, runner.num_parameters).encode())
    try:
        serve_steps(runner, plugin, steps, replies)
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


def serve_steps(runner: ModelRunner, plugin: RankPlugin | None, steps: Connection,
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
            replies.send_bytes(run_call(require_plugin(plugin), msg.payload))
            continue
        try:
            runner.execute(msg.chunks, plugin_hook(plugin, msg.chunks, msg.payload))
        except LayerHookError:
            log.exception("rank %d: a plugin layer hook failed; the step completed", runner.tp.rank)


def _watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this rank soon after its leader process is gone, however it died.

    A watchdog thread, not PR_SET_PDEATHSIG: that signal fires when the *thread* that
    started us exits, and engines are often built on short-lived threads. A leader that
    dies mid-step is also noticed at once by the gloo collectives ("connection closed").
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="pdserve-parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
