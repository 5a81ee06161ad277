"""The decode worker process: ``pdserve decode --model DIR [--port P]
[--tensor-parallel-size r] [--kv-port K] [--ready-file PATH] [--redis-url URL]``.

Start-up order (gRPC and fork do not mix): build the engine — it spawns the r-1 follower
ranks and rank 0's plugin starts the KV rendezvous store — run one warm-up step, start
the engine loop, and only then create the gRPC server. ``DecodeServicer`` is the thin
protobuf adapter; everything engine-side happens on the ``DecodeLoop`` thread.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Iterator

import grpc

from cluster.fingerprint import fingerprint_model_dir
from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.records import WorkerLoad
from decode_worker.engine_loop import DecodeLoop, Local, Open, Reserve
from decode_worker.kv_plugin import PLUGIN, DecodeKVConfig
from engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    load_model_config,
)
from engine.core import EngineCore, RequestOutput
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

log = logging.getLogger(__name__)


class DecodeServicer(LoopServicerMixin, pb_grpc.DecodeWorkerServicer):
    """protobuf ⇄ ``DecodeLoop`` commands; see ``worker.proto`` for each RPC's contract."""

    loop: DecodeLoop

    def __init__(self, loop: DecodeLoop, identity: Identity) -> None:
        self.loop = loop
        self.identity = identity

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext
                ) -> pb.ReserveResponse:
        try:
            if request.transfer_id == 0:
                raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id must not be 0")
            params = sampling_params_from_proto(request.sampling)
            target = self.loop.call(Reserve(request.request_id, list(request.prompt_token_ids),
                                            params, request.transfer_id), CALL_TIMEOUT_S)
        except WorkerError as exc:
            abort_with(context, exc)
        if target is None:
            usage = self.loop.call(Info(), CALL_TIMEOUT_S).kv
            return pb.ReserveResponse(
                accepted=False, reason=f"out of KV blocks ({usage.free + usage.cached} of "
                f"{usage.total} free)")
        return pb.ReserveResponse(
            accepted=True, num_blocks=-(-target.num_tokens // self.loop.core.config.cache.block_size),
            target=pb.KVTarget(kv_address=f"{target.address.host}:{target.address.port}",
                               tensor_parallel_size=target.tp_size,
                               transfer_id=target.transfer_id))

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.TokenChunk]:
        rid = request.request_id
        try:
            # the first token and cached count come with the KV; the router's copies
            # (0: absent) are only checked
            stream = self.loop.call(Open(rid, request.first_token_id or None,
                                         request.num_cached_tokens or None), CALL_TIMEOUT_S)
        except WorkerError as exc:
            abort_with(context, exc)
        yield from self._relay(rid, stream, context)

    def GenerateLocal(self, request: pb.GenerateLocalRequest, context: grpc.ServicerContext
                      ) -> Iterator[pb.TokenChunk]:
        rid = request.request_id
        try:
            if not request.prompt_token_ids:
                raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
            params = sampling_params_from_proto(request.sampling)
            stream = self.loop.call(Local(rid, list(request.prompt_token_ids), params),
                                    CALL_TIMEOUT_S)
        except WorkerError as exc:
            abort_with(context, exc)
        yield from self._relay(rid, stream, context)

    def _relay(self, rid: str, stream: OutputStream[RequestOutput],
               context: grpc.ServicerContext) -> Iterator[pb.TokenChunk]:
        """The request's outputs as chunks; however the call ends (cancel, deadline,
        error), the request is freed."""
        context.add_callback(lambda: self._abort_quietly(rid, "the Generate call ended"))
        num_completion = 0
        while True:
            try:
                out = stream.get(context.time_remaining())
            except WorkerError as exc:
                self._abort_quietly(rid, "the Generate call ended")
                abort_with(context, exc)
            num_completion += len(out.new_token_ids)
            chunk = pb.TokenChunk(token_ids=out.new_token_ids, text=out.text_delta)
            if out.finished:
                chunk.finish_reason = out.finish_reason or "stop"
                # cached_tokens: the prefill worker's count, arrived with the KV
                chunk.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens,
                                              completion_tokens=num_completion,
                                              cached_tokens=out.num_cached_tokens))
            yield chunk
            if out.finished:
                return


def build_engine(args: argparse.Namespace, fingerprint: str) -> EngineCore:
    """The decode engine with its KV plugin; spawns the follower ranks (call before any
    gRPC object exists). Rank 0's KV rendezvous store binds ``args.kv_port`` itself (0:
    any); ``DecodeHandoff.address`` tells the port it got."""
    kv = DecodeKVConfig(args.host, args.kv_port, fingerprint, timeout_s=args.transfer_timeout)
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
    loop = DecodeLoop(core, args.transfer_timeout)
    loop.start()
    identity = Identity(args.worker_id or f"decode-{uuid.uuid4().hex[:12]}", "decode",
                        args.tensor_parallel_size, fingerprint)
    servicer = DecodeServicer(loop, identity)

    def load() -> WorkerLoad:
        info = loop.call(Info(), CALL_TIMEOUT_S)
        return WorkerLoad(info.kv.free + info.kv.cached, info.kv.total, info.running,
                          info.waiting)

    kv = loop.handoff.address  # the port rank 0's store bound
    endpoint = Endpoint(identity, KVLayout.from_engine_config(core.config, fingerprint),
                        f"{kv.host}:{kv.port}",
                        lambda server: pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server),
                        load)
    return serve_until_signal(args, loop, endpoint)
