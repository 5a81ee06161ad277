"""The prefill kind's gRPC edge: ``PrefillServicer``, the thin protobuf adapter of
``Prefill`` (``Abort``, ``Info``, ``KVSnapshot`` and ``SetRole`` are ``worker.servicer``'s).

Everything engine-side happens on the engine-loop thread (``PrefillLoop``'s side of it).
The process that serves it is ``role_worker.server`` (``pdserve prefill`` is
``pdserve worker --role prefill``).
"""

from __future__ import annotations

import logging
import time

import grpc

from cluster import pause_points
from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.kv_target import KVTarget
from engine.tp.distributed import StoreAddress
from prefill_worker.engine_loop import PrefillDone, Submit
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


class PrefillServicer(LoopServicerMixin, pb_grpc.PrefillWorkerServicer):
    """protobuf ⇄ ``PrefillLoop`` commands; see ``worker.proto`` for each RPC's contract."""

    async def Prefill(self, request: pb.PrefillRequest,  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        attempt = await attempt_of(request, context)
        stream: OutputStream[PrefillDone] = OutputStream(1)
        remaining = context.time_remaining()
        held = True  # unless the loop refused it: then nothing is held, nothing to abort
        try:  # however the call ends (cancelled, expired, failed), the attempt is freed
            try:
                submit = Submit(attempt, list(request.prompt_token_ids),
                                sampling_params_from_proto(request.sampling),
                                request.target.transfer_id, _dest(request.target), stream,
                                None if remaining is None else time.monotonic() + remaining,
                                request.client_request_id, request.num_resumed_tokens,
                                request.target.num_cached_blocks, request.moved_from,
                                request.max_queued_tokens)
                if pause_points.enabled():
                    pause_points.record("prefill.received", attempt_id=attempt)
                await self.loop.acall(submit, call_timeout(context))
            except WorkerError as exc:
                held = exc.code not in REFUSALS
                await abort_with(context, exc)
            self.watch_lease(attempt, request.lease)
            try:
                done = await stream.get(context.time_remaining())
            except WorkerError as exc:
                await abort_with(context, exc)
        finally:
            if held:
                self.on_call_end(attempt, "the Prefill call ended")
        rate = self.loop.figures.prefill_rate.tokens_per_s  # worker.prefill_rate
        response = pb.PrefillResponse(first_token_id=done.first_token_id,
                                      num_cached_tokens=done.num_cached_tokens,
                                      num_prompt_tokens=done.num_prompt_tokens,
                                      prefill_tokens_per_s=rate)
        if done.first_token_logprobs is not None:
            response.first_token_logprobs.CopyFrom(logprobs_to_proto(done.first_token_logprobs))
        response.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in done.prompt_logprobs)
        if done.times is not None:
            t = done.times
            response.timings.CopyFrom(pb.PrefillTimings(
                queue_us=_us(t.queue_s), compute_us=_us(t.compute_s),
                transfer_us=_us(t.transfer_s)))
        return response


def _us(seconds: float) -> int:
    return max(0, round(seconds * 1e6))


# What a refused Submit answers: the loop holds nothing for the call (and ALREADY_EXISTS:
# what it holds under that attempt id is another call's)
REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
                      grpc.StatusCode.RESOURCE_EXHAUSTED})


def _dest(target: pb.KVTarget) -> StoreAddress:
    try:
        host, port = KVTarget(target.transfer_id, target.kv_address,
                              target.tensor_parallel_size).host_port()
    except ValueError as exc:
        raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    return StoreAddress(host, port)
