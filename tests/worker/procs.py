"""Worker processes for the worker tests: start one through the CLI with the tests'
worker options (``spawn_worker``, a ``tests.processes.Proc``), and the worker layer's one
leak check (``assert_idle``), retried while freeing is still under way."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cluster.internal.v1 import worker_pb2 as pb
from engine import SamplingParams
from tests.processes import Proc, spawn, wait_until

RPC_TIMEOUT_S = 60.0
IDLE_TIMEOUT_S = 15.0
NUM_KV_BLOCKS = 64


def spawn_worker(role: str, model_dir: Path, tmp: Path, *extra: str, name: str | None = None,
                 env: Mapping[str, str] | None = None, transfer_timeout_s: float = 10.0) -> Proc:
    """Start ``pdserve ROLE`` (64 KV blocks, prefill chunks of 32 tokens)."""
    return spawn(name or role, [
        role, "--model", str(model_dir), "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--max-num-batched-tokens", "32", "--transfer-timeout", str(transfer_timeout_s),
        "--grace", "2", *extra], tmp, env=dict(env or {}))


def proto_params(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                            top_k=p.top_k, stop=p.stop, stop_token_ids=p.stop_token_ids,
                            ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def idle_problem(info: pb.WorkerInfo) -> str | None:
    """Why a worker's ``Info`` shows it holding something (None when it holds nothing):
    every block must be free or cached, nothing in use, pinned, pending, running or
    waiting, and the block counts must add up."""
    kv = info.kv
    if kv.free_blocks + kv.cached_blocks + kv.pinned_blocks + kv.in_use_blocks != kv.total_blocks:
        return f"block counts do not add up: {info}"
    held = (kv.in_use_blocks, kv.pinned_blocks, info.pending_transfers, info.running_requests,
            info.waiting_requests)
    return None if held == (0, 0, 0, 0, 0) else f"still holds (in use, pinned, pending, " \
        f"running, waiting) = {held}: {info}"


def assert_idle(*stubs: Any, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """The worker layer's leak check: each worker (a stub with ``Info``) is idle within
    ``timeout_s`` (it may still be freeing, e.g. after a cancel or a SIGCONT)."""
    for stub in stubs:
        last: list[str | None] = [None]

        def idle(stub: Any = stub, last: list[str | None] = last) -> bool:
            last[0] = idle_problem(stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S))
            return last[0] is None

        try:
            wait_until(idle, timeout_s, "the worker to free everything", period_s=0.05)
        except AssertionError:
            raise AssertionError(last[0]) from None
