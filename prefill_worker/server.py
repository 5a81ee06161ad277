"""The prefill worker process: ``pdserve prefill --model DIR [--port P]
[--tensor-parallel-size p] [--ready-file PATH] [--redis-url URL]``.

Start-up order (gRPC and fork do not mix): build the engine (spawns the p-1 follower
ranks), run one warm-up step, start the engine loop, and only then create the gRPC
server. ``PrefillServicer`` is the thin protobuf adapter; everything engine-side happens
on the ``PrefillLoop`` thread. The prefill worker has no KV endpoint of its own: it
connects to each decode worker's store on demand.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid

import grpc

from cluster.fingerprint import fingerprint_model_dir
from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.records import WorkerLoad
from engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    load_model_config,
)
from engine.core import EngineCore
from engine.distributed import StoreAddress
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from kvtransfer import KVLayout
from pdserve.worker_common import (
    Endpoint,
    Identity,
    LoopServicerMixin,
    abort_with,
    sampling_params_from_proto,
    serve_until_signal,
)
from pdserve.worker_loop import (
    CALL_TIMEOUT_S,
    Info,
    OutputStream,
    WorkerError,
)
from prefill_worker.engine_loop import PrefillDone, PrefillLoop, Submit
from prefill_worker.kv_plugin import PLUGIN, PrefillKVConfig

log = logging.getLogger(__name__)

FAULT_HOOK_ENV = "PDSERVE_TEST_KV_FAULT_HOOK"
"""Tests only: ``module:factory`` of a ``kvtransfer`` sender fault hook for every rank."""


class PrefillServicer(LoopServicerMixin, pb_grpc.PrefillWorkerServicer):
    """protobuf ⇄ ``PrefillLoop`` commands; see ``worker.proto`` for each RPC's contract."""

    def __init__(self, loop: PrefillLoop, identity: Identity) -> None:
        self.loop = loop
        self.identity = identity

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext
                ) -> pb.PrefillResponse:
        rid = request.request_id
        stream: OutputStream[PrefillDone] = OutputStream(1)
        try:
            submit = Submit(rid, list(request.prompt_token_ids), sampling_params_from_proto(request.sampling),
                            request.target.transfer_id, _dest(request.target), stream)
            self.loop.call(submit, CALL_TIMEOUT_S)
        except WorkerError as exc:
            abort_with(context, exc)
        # a cancelled or expired call stops the request and releases its blocks
        context.add_callback(lambda: self._abort_quietly(rid, "the Prefill call ended"))
        try:
            done = stream.get(context.time_remaining())
        except WorkerError as exc:
            self._abort_quietly(rid, "the Prefill call ended")
            abort_with(context, exc)
        return pb.PrefillResponse(first_token_id=done.first_token_id,
                                  num_cached_tokens=done.num_cached_tokens,
                                  num_prompt_tokens=done.num_prompt_tokens)



def _dest(target: pb.KVTarget) -> StoreAddress:
    host, _, port = target.kv_address.rpartition(":")
    if not host or not port.isdigit() or target.transfer_id == 0:
        raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"bad KV target {target.kv_address!r} / transfer {target.transfer_id}")
    return StoreAddress(host, int(port))


def build_engine(args: argparse.Namespace, fingerprint: str) -> EngineCore:
    """The prefill engine with its KV plugin; spawns the follower ranks (call before any
    gRPC object exists)."""
    # tests only: "module:factory" of a kvtransfer sender fault hook (see PrefillKVConfig)
    fault_hook = os.environ.get(FAULT_HOOK_ENV) or None
    if fault_hook is not None:
        log.warning("test-only KV fault hook %s is active (%s)", fault_hook, FAULT_HOOK_ENV)
    kv = PrefillKVConfig(fingerprint, timeout_s=args.transfer_timeout, fault_hook=fault_hook)
    config = EngineConfig(
        model=load_model_config(args.model),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        rank_plugin=PLUGIN, rank_plugin_config=kv.to_json())
    return EngineCore(config, load_tokenizer(args.model))


def warm_up(core: EngineCore) -> None:
    """One local request through every rank; its blocks end free or cached."""
    core.add_request("warm-up", [0], SamplingParams(max_tokens=1, temperature=0))
    while core.has_unfinished():
        core.step()


def main(args: argparse.Namespace) -> int:
    fingerprint = fingerprint_model_dir(args.model)
    core = build_engine(args, fingerprint)
    try:
        warm_up(core)
    except BaseException:
        core.shutdown()
        raise
    loop = PrefillLoop(core)
    loop.start()
    identity = Identity(args.worker_id or f"prefill-{uuid.uuid4().hex[:12]}", "prefill",
                        args.tensor_parallel_size, fingerprint)
    servicer = PrefillServicer(loop, identity)

    def load() -> WorkerLoad:
        info = loop.call(Info(), CALL_TIMEOUT_S)
        return WorkerLoad(info.kv.free + info.kv.cached, info.kv.total, info.running,
                          info.waiting)

    endpoint = Endpoint(identity, KVLayout.from_engine_config(core.config, fingerprint), "",
                        lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(servicer, server),
                        load)
    return serve_until_signal(args, loop, endpoint)
