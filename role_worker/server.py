"""The worker process that serves either role: ``pdserve worker --role prefill|decode
--model DIR [...]`` (the options of ``pdserve prefill`` and ``pdserve decode``, which run
this program with their role).

Its ``WorkerKind`` builds the ``WorkerLoop`` and registers both the ``PrefillWorker`` and
the ``DecodeWorker`` services, so whichever role it serves, the calls of that role find
their service; ``SetRole`` (either service, ``worker.servicer``) switches it.
"""

from __future__ import annotations

import argparse

import grpc

from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from decode_worker.server import DecodeServicer
from engine.core.engine_core import EngineCore
from prefill_worker.server import PrefillServicer
from role_worker.engine_loop import WorkerLoop
from worker.loop import EngineLoop
from worker.metrics import WorkerMetrics
from worker.process import WorkerKind, run_worker
from worker.server import Identity

ROLES = ("prefill", "decode")


def kind(role: str) -> WorkerKind:
    """The switchable worker, starting as ``role``."""
    if role not in ROLES:
        raise ValueError(f"--role must be one of {ROLES}, got {role!r}")

    def make_loop(core: EngineCore, args: argparse.Namespace,
                  metrics: WorkerMetrics) -> EngineLoop:
        return WorkerLoop(core, args.transfer_timeout, role, max_requests=args.max_requests,
                          metrics=metrics)

    def add_servicers(loop: EngineLoop, identity: Identity, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(loop, identity), server)
        pb_grpc.add_DecodeWorkerServicer_to_server(DecodeServicer(loop, identity), server)

    return WorkerKind(role=role, make_loop=make_loop, add_servicer=add_servicers)


def main(args: argparse.Namespace) -> int:
    return run_worker(args, kind(args.role))
