"""Worker processes for the worker tests: start one through the CLI with the tests'
worker options and a ready file, wait for it (gRPC channel, rank pids), stop it (and make
sure its ranks are gone), and the leak check through ``Info``. Process plumbing shared
with other tests lives in ``tests.processes``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cluster.internal.v1 import worker_pb2 as pb
from engine import SamplingParams
from tests.factories import REPO_ROOT
from tests.processes import alive, children
from worker.server import ReadyInfo

START_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
NUM_KV_BLOCKS = 64


@dataclass
class Worker:
    role: str
    name: str  # unique in its directory: names the log and ready files
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: Path
    ready: ReadyInfo | None = None
    channel: grpc.Channel | None = None
    rank_pids: list[int] = field(default_factory=list)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def spawn(role: str, model_dir: Path, tmp: Path, *extra: str, name: str | None = None,
          env: Mapping[str, str] | None = None, transfer_timeout_s: float = 10.0) -> Worker:
    """Start ``pdserve ROLE`` (64 KV blocks, prefill chunks of 32 tokens)."""
    name = name or role
    log_path, ready_path = tmp / f"{name}.log", tmp / f"{name}.ready.json"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", role, "--model", str(model_dir),
             "--ready-file", str(ready_path),
             "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-batched-tokens", "32",
             "--transfer-timeout", str(transfer_timeout_s), "--grace", "2", *extra],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                 **(env or {})})
    return Worker(role, name, proc, log_path, ready_path)


def wait_ready(worker: Worker) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not worker.ready_path.exists():
        assert worker.proc.poll() is None, f"{worker.name} exited:\n{worker.log_tail()}"
        assert time.monotonic() < deadline, f"{worker.name} not ready:\n{worker.log_tail()}"
        time.sleep(0.2)
    worker.ready = ReadyInfo.read(worker.ready_path)
    worker.channel = grpc.insecure_channel(worker.ready.grpc_address)
    worker.rank_pids = children(worker.proc.pid)


def stop(worker: Worker) -> None:
    """SIGTERM (after SIGCONT, in case it was stopped), SIGKILL if it lingers."""
    if worker.proc.poll() is None:
        worker.proc.send_signal(signal.SIGCONT)  # harmless unless it was stopped
        worker.proc.terminate()
        try:
            worker.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait(STOP_TIMEOUT_S)
    if worker.channel is not None:
        worker.channel.close()


def stop_all(workers: list[Worker]) -> None:
    """Stop every worker, then kill any of their rank processes still alive."""
    for w in workers:
        stop(w)
    for w in workers:
        for pid in w.rank_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def proto_params(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                            top_k=p.top_k, stop=p.stop, stop_token_ids=p.stop_token_ids,
                            ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def assert_no_leaks(*stubs: Any) -> None:
    """Each worker (a stub with ``Info``): every block free or cached, nothing in use,
    pinned, pending, running or waiting."""
    for stub in stubs:
        info = stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        kv = info.kv
        assert kv.free_blocks + kv.cached_blocks + kv.pinned_blocks + kv.in_use_blocks == \
            kv.total_blocks == NUM_KV_BLOCKS, info
        assert (kv.in_use_blocks, kv.pinned_blocks, info.pending_transfers,
                info.running_requests, info.waiting_requests) == (0, 0, 0, 0, 0), info
