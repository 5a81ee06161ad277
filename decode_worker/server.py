"""The decode kind's gRPC edge: ``DecodeServicer``, the thin protobuf adapter of
``Reserve``, ``Generate`` and ``GenerateLocal`` (``Abort``, ``Info``, ``KVSnapshot`` and
``SetRole`` are ``worker.servicer``'s).

Everything engine-side happens on the engine-loop thread (``DecodeLoop``'s side of it,
which receives KV on rank 0's rendezvous store, ``--kv-port``). The process that serves it
is ``role_worker.server`` (``pdserve decode`` is ``pdserve worker --role decode``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from cluster import pause_points
from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from decode_worker.engine_loop import Local, Open, Refuse, Reserve
from engine.core.engine_core import RequestOutput, merge_outputs
from engine.tp.sharding import num_blocks_for
from worker.commands import WorkerError
from worker.servicer import (
    LoopServicerMixin,
    abort_with,
    attempt_of,
    call_timeout,
    logprobs_to_proto,
    sampling_params_from_proto,
)
from worker.streams import OutputStream

log = logging.getLogger(__name__)


class DecodeServicer(LoopServicerMixin, pb_grpc.DecodeWorkerServicer):
    """protobuf ⇄ ``DecodeLoop`` commands; see ``worker.proto`` for each RPC's contract."""

    async def Reserve(self, request: pb.ReserveRequest,  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        attempt = await attempt_of(request, context)
        # its Prefill went out with it: a Reserve that fails or never runs refuses the KV
        ahead = request.HasField("expected_cached_blocks") and request.transfer_id != 0
        try:
            if request.transfer_id == 0:
                raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id must not be 0")
            params = sampling_params_from_proto(request.sampling)
            target = await self.loop.acall(Reserve(
                attempt, list(request.prompt_token_ids), params,
                request.transfer_id, request.wait_ms / 1000 if request.wait_ms else None,
                request.client_request_id, request.num_resumed_tokens,
                request.expected_cached_blocks if request.HasField("expected_cached_blocks")
                else None),
                call_timeout(context))
            if isinstance(target, str):
                return pb.ReserveResponse(accepted=False, reason=target)
            self.watch_lease(attempt, request.lease)
            if pause_points.enabled():
                pause_points.record("decode.reserved", request_id=request.client_request_id,
                                    attempt_id=attempt, transfer_id=request.transfer_id)
                await pause_points.apause("decode.reserved",
                                          request_id=request.client_request_id,
                                          attempt_id=attempt, transfer_id=request.transfer_id)
        except asyncio.CancelledError:  # the caller left: it may never learn of a reservation
            self.on_call_end(attempt, "the Reserve call was cancelled")
            if ahead:
                self.loop.post(Refuse(request.transfer_id))
            raise
        except WorkerError as exc:
            if exc.code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS):
                self.on_call_end(attempt, "the Reserve call failed")  # it may hold it
            if ahead:
                self.loop.post(Refuse(request.transfer_id))
            await abort_with(context, exc)
        block_size = self.loop.core.config.cache.block_size
        return pb.ReserveResponse(
            accepted=True, num_blocks=num_blocks_for(len(request.prompt_token_ids), block_size),
            target=pb.KVTarget(kv_address=target.kv_address,
                               tensor_parallel_size=target.tensor_parallel_size,
                               transfer_id=target.transfer_id,
                               num_cached_blocks=target.num_cached_blocks))

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 - gRPC name
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenChunk]:
        attempt = await attempt_of(request, context)
        stream: OutputStream[RequestOutput] = OutputStream()  # the loop bounds it at Open
        command = Open(attempt, stream)  # the first token and cached count come with the KV
        async for chunk in self._relay(attempt, command, stream, context):
            yield chunk

    async def GenerateLocal(self, request: pb.GenerateLocalRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenChunk]:
        attempt = await attempt_of(request, context)
        try:
            if not request.prompt_token_ids:
                raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")
            params = sampling_params_from_proto(request.sampling)
        except WorkerError as exc:
            await abort_with(context, exc)
        stream: OutputStream[RequestOutput] = OutputStream(params.max_tokens + 2)
        command = Local(attempt, list(request.prompt_token_ids), params, stream,
                        request.client_request_id, request.num_resumed_tokens)
        async for chunk in self._relay(attempt, command, stream, context, request.lease):
            yield chunk

    async def _relay(self, attempt: str, command: Open | Local,
                     stream: OutputStream[RequestOutput],
                     context: grpc.aio.ServicerContext,
                     lease: pb.Lease | None = None) -> AsyncIterator[pb.TokenChunk]:
        """Open the stream, then the attempt's outputs as chunks; however the call ends
        (finish, cancel, deadline, error, the router gone), the attempt is freed — unless
        the loop refused to open it (then what it holds under the id, if anything, is
        another call's: an ALREADY_EXISTS Local, or an open stream's reservation)."""
        started = time.monotonic()
        try:
            await self.loop.acall(command, call_timeout(context))
        except WorkerError as exc:
            if exc.code not in _NOT_OURS:
                self.on_call_end(attempt, "the Generate call failed")
            await abort_with(context, exc)
        except asyncio.CancelledError:
            self.on_call_end(attempt, "the Generate call was cancelled")
            raise
        if lease is not None:
            self.watch_lease(attempt, lease)
        num_completion, first = 0, True
        try:
            while True:
                try:
                    out = await stream.get(context.time_remaining())
                except WorkerError as exc:
                    await abort_with(context, exc)
                if not out.finished:  # fallen behind the engine: what is here goes as one
                    out = merge_outputs(out, stream.ready())
                chunk = pb.TokenChunk(token_ids=out.new_token_ids, text=out.text_delta)
                if out.logprobs:  # a first token admitted with its KV has none here
                    chunk.logprobs.extend(logprobs_to_proto(lp) for lp in out.logprobs
                                          if lp is not None)
                if out.prompt_logprobs:  # prefilled here (colocated)
                    chunk.prompt_logprobs.extend(logprobs_to_proto(lp)
                                                 for lp in out.prompt_logprobs)
                if first:  # how long the first chunk took here (from the later of the call
                    # and the loop noticing the KV's arrival)
                    since = max(started, stream.inputs_arrived_at or started)
                    chunk.timings.first_chunk_us = round((time.monotonic() - since) * 1e6)
                    first = False
                num_completion += len(out.new_token_ids)
                if out.finished:
                    chunk.finish_reason = out.finish_reason or "stop"
                    # cached_tokens: the prefill worker's count, arrived with the KV
                    chunk.usage.CopyFrom(pb.Usage(prompt_tokens=out.num_prompt_tokens,
                                                  completion_tokens=out.num_resumed_tokens
                                                  + num_completion,
                                                  cached_tokens=min(out.num_cached_tokens,
                                                                    out.num_prompt_tokens)))
                yield chunk
                if out.finished:
                    return
        finally:
            self.on_call_end(attempt, "the Generate call ended")


# Refusals of Open/Local after which the id's state (if any) belongs to another call.
_NOT_OURS = frozenset({grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                       grpc.StatusCode.NOT_FOUND})
