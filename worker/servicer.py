"""The protobuf edge both worker kinds share: ``Abort`` and ``Info`` over an ``EngineLoop``,
the end of a call (``on_call_end``), and the conversions between ``cluster.internal.v1``
messages and the engine's types.

A thin gRPC adapter, asynchronous (``grpc.aio``): the one module of ``worker/`` that imports
the generated internal API. Everything it hands to the loop is a plain dataclass
(``worker.loop`` commands); it awaits replies and results, never blocking a thread.
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

import grpc

from cluster.internal.v1 import worker_pb2 as pb
from cluster.kv_events import pack_hashes
from cluster.worker_control import SWITCHED_TO_KEY
from engine.sampling_params import SamplingParams, StructuredOutput, TokenLogprobs
from worker.commands import (
    CALL_TIMEOUT_S,
    Abort,
    Info,
    LoopInfo,
    OfferMoves,
    SetRole,
    WorkerError,
)
from worker.loop import EngineLoop
from worker.server import Identity


def call_timeout(context: grpc.aio.ServicerContext) -> float:
    """How long an engine-loop command of this RPC may take: the call's remaining time,
    at most ``CALL_TIMEOUT_S`` (a command not started by then never runs)."""
    remaining = context.time_remaining()
    return CALL_TIMEOUT_S if remaining is None else max(0.0, min(CALL_TIMEOUT_S, remaining))


async def attempt_of(request: Any, context: grpc.aio.ServicerContext) -> str:
    """The key of what a request message names: its ``attempt_id`` (a call without one
    ends with INVALID_ARGUMENT)."""
    if not request.attempt_id:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call names no attempt_id")
    return str(request.attempt_id)


async def abort_with(context: grpc.aio.ServicerContext, error: WorkerError,
                     trailing_metadata: tuple[tuple[str, str], ...] = ()) -> NoReturn:
    """Ends the RPC with ``error``'s status (raises)."""
    await context.abort(error.code, error.message, trailing_metadata)
    raise AssertionError("unreachable: context.abort raises")


# how long a request a switch away from decode parks waits for its move (then it is freed)
SWITCH_MOVE_WAIT_S = 10.0

class LoopServicerMixin:
    """``Abort``, ``Info``, ``KVSnapshot`` and ``SetRole`` RPCs over an ``EngineLoop``,
    shared by both worker kinds."""

    def __init__(self, loop: EngineLoop, identity: Identity) -> None:
        self.loop = loop
        self.identity = identity
        # one SetRole at a time, its listeners and moves included: two that overlapped
        # could leave the registration (and metrics) on the role the loop no longer has
        self._switching = asyncio.Lock()

    def on_call_end(self, attempt_id: str, reason: str) -> None:
        """However a call that holds ``attempt_id`` ends (finished, failed, cancelled by
        its caller or its deadline, the caller gone): abort whatever is left of that
        attempt — never another one, so a late callback cannot touch a retry. Posted, not
        awaited: it runs even while the handler is being cancelled, and aborting a
        finished attempt is a no-op."""
        self.loop.leases.forget(attempt_id)
        self.loop.post(Abort(attempt_id, reason, call_ended=True))

    def watch_lease(self, attempt_id: str, lease: pb.Lease) -> None:
        """Free the attempt if its router's lease goes (``worker.leases``); call once the
        loop holds the attempt (the loop forgets leases of attempts it no longer holds)."""
        self.loop.leases.watch(attempt_id, lease.key, lease.ttl_ms / 1000)

    async def Abort(self, request: pb.AbortRequest,  # noqa: N802 - gRPC name
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        attempt_id = await attempt_of(request, context)
        try:
            found: bool = await self.loop.acall(Abort(attempt_id), call_timeout(context))
            self.loop.leases.forget(attempt_id)
            return pb.AbortResponse(found=found)
        except WorkerError as exc:
            await abort_with(context, exc)

    async def Info(self, request: pb.InfoRequest,  # noqa: N802 - gRPC name
                   context: grpc.aio.ServicerContext) -> pb.WorkerInfo:
        try:
            return info_to_proto(self.identity,
                                 await self.loop.acall(Info(), call_timeout(context)),
                                 role=self.loop.role)
        except WorkerError as exc:
            await abort_with(context, exc)

    async def SetRole(self, request: pb.SetRoleRequest,  # noqa: N802 - gRPC name
                      context: grpc.aio.ServicerContext) -> pb.SetRoleReply:
        """The loop switches first (new work of the new role from its next command on);
        then the role's listeners (registration, metrics) learn of it, off the event loop.
        Calls that overlap take turns, so the listeners hear the roles in the loop's order."""
        async with self._switching:
            try:
                previous = await self.loop.acall(SetRole(request.role), call_timeout(context))
            except WorkerError as exc:
                await abort_with(context, exc)
            for listener in self.loop.role_listeners:
                await asyncio.to_thread(listener, request.role)
            if request.move_decoding and request.role != "decode":  # after the record says so
                try:
                    await self._check_move_targets()
                    await self.loop.acall(OfferMoves(SWITCH_MOVE_WAIT_S, draining=False),
                                          call_timeout(context))
                except (WorkerError, TypeError) as exc:  # TypeError: a loop that cannot move
                    await abort_with(context, WorkerError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"switched to {request.role}, but its decoding requests cannot move: "
                        f"{exc}"), ((SWITCHED_TO_KEY, request.role),))
            return pb.SetRoleReply(role=request.role, previous_role=previous,
                                   roles=list(self.loop.roles))

    async def _check_move_targets(self) -> None:
        """``WorkerError`` unless another decode worker serves (the registry's word): a
        move offered with none would fail every stream it parks, where they finish here."""
        check = self.loop.move_targets
        try:
            serving = check is not None and await asyncio.to_thread(check)
        except Exception as exc:  # noqa: BLE001 - Redis down: nowhere known to move to
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the registry did not answer ({exc}); they finish here") from None
        if not serving:
            raise WorkerError(grpc.StatusCode.FAILED_PRECONDITION,
                              "no other decode worker is serving; they finish here")

    async def KVSnapshot(self, request: pb.KVSnapshotRequest,  # noqa: N802 - gRPC name
                         context: grpc.aio.ServicerContext) -> pb.KVSnapshotReply:
        publisher = self.loop.kv_events
        if publisher is None:
            return pb.KVSnapshotReply(publishing=False)
        snapshot = publisher.snapshot()
        return pb.KVSnapshotReply(publishing=True, epoch=snapshot.epoch, seq=snapshot.seq,
                                  block_hashes=pack_hashes(list(snapshot.block_hashes)))


def sampling_kwargs(msg: Any) -> dict[str, Any]:
    """``pdserve.internal.v1.SamplingParams`` → keyword arguments of the engine's
    ``SamplingParams`` (which validates them)."""
    return dict(max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p,
                top_k=msg.top_k, seed=msg.seed if msg.HasField("seed") else None,
                stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                ignore_eos=msg.ignore_eos, min_p=msg.min_p, min_tokens=msg.min_tokens,
                presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                # proto3's 0 is "not set" (an older sender): off is 1
                repetition_penalty=msg.repetition_penalty or 1.0,
                logit_bias=dict(msg.logit_bias),
                logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
                structured=StructuredOutput(msg.structured.kind, msg.structured.spec)
                if msg.HasField("structured") else None)


def logprobs_to_proto(found: TokenLogprobs) -> pb.TokenLogprobs:
    """One token's ``TokenLogprobs`` (the engine's) → its message."""
    return pb.TokenLogprobs(token_id=found.token_id, logprob=found.logprob, rank=found.rank,
                            top_token_ids=[t for t, _ in found.top],
                            top_logprobs=[lp for _, lp in found.top])


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Validated engine ``SamplingParams``; bad values → ``INVALID_ARGUMENT``."""
    try:
        return SamplingParams(**sampling_kwargs(msg))
    except ValueError as exc:
        raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def info_to_proto(identity: Identity, info: LoopInfo, role: str = "") -> pb.WorkerInfo:
    """A loop's info snapshot → ``WorkerInfo`` (``role``: the one served now; default the
    identity's)."""
    kv = info.kv
    return pb.WorkerInfo(
        worker_id=identity.worker_id, role=role or identity.role,
        tensor_parallel_size=identity.tensor_parallel_size,
        model_fingerprint=identity.model_fingerprint,
        kv=pb.KVCacheUsage(total_blocks=kv.total, free_blocks=kv.free,
                           cached_blocks=kv.cached, pinned_blocks=kv.pinned,
                           in_use_blocks=kv.in_use),
        pending_transfers=info.pending_transfers, open_kv_channels=info.open_kv_channels,
        running_requests=info.running, waiting_requests=info.waiting,
        num_preemptions=info.num_preemptions, num_expired_requests=info.num_expired,
        num_started_requests=info.num_started, num_failed_transfers=info.num_failed_transfers,
        attempt_ids=info.attempt_ids, watched_leases=info.watched_leases,
        queued_commands=info.queued_commands, num_lease_aborts=info.num_lease_aborts,
        num_expired_commands=info.num_expired_commands,
        num_unexpected_acks=info.num_unexpected_acks)
