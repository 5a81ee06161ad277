"""The router's calls to its workers: the protobuf plumbing of the internal API
(``cluster.internal.v1``) and the one classifier of what a failed call means.

A thin gRPC adapter: ``router.lifecycle`` drives a request's lifecycle in terms of the
dataclasses here (``Reservation``, ``Prefilled``, ``OutputChunk``s) and ``KVTarget``, and
never sees a protobuf message. Each ``start_*`` returns the live ``grpc.aio`` call, so the
caller can cancel it (or have ``WorkerPool.watched`` cancel it); ``classify`` turns any
``AioRpcError`` into a ``CallFailure``.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.kv_events import unpack_hashes
from cluster.kv_target import KVTarget
from cluster.leases import Lease
from cluster.prefill_queue import is_queue_refusal
from engine.sampling_params import TokenLogprobs
from router.outputs import OutputChunk, Usage
from router.trace import PrefillTimes
from router.validation import ValidRequest
from router.workers import WorkerPool

ABORT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Reservation:
    """A decode worker's answer to Reserve: ``accepted`` (then ``target`` is set) or not
    (``reason`` says why: no room now)."""

    accepted: bool
    num_blocks: int = 0
    target: KVTarget | None = None
    reason: str = ""


@dataclass(frozen=True)
class Prefilled:
    """A prefill worker's answer: the KV and the first token reached the decode worker."""

    first_token_id: int
    num_cached_tokens: int
    num_prompt_tokens: int
    times: PrefillTimes | None = None  # the prefill worker's report (router.trace)
    first_token_logprobs: TokenLogprobs | None = None  # when the request asked for them
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # prompt tokens 1.., when asked for
    prefill_tokens_per_s: float = 0.0  # the prefill worker's measured rate (0: none yet)


class Failure(enum.Enum):
    RETRY = "retry"  # this worker failed the call: another attempt (elsewhere) may succeed
    BUSY = "busy"  # the worker is at a limit (RESOURCE_EXHAUSTED): wait or go elsewhere
    QUEUED = "queued"  # a Prefill's queue was over its limit (``cluster.prefill_queue``)
    ALREADY_EXISTS = "already exists"  # the request id is held there by another request
    DEADLINE = "deadline"  # the request's own deadline passed
    REFUSED = "refused"  # the worker refused what the router sent: a router bug (INTERNAL)


# Codes of a failed call worth another attempt elsewhere (before the first token).
# NOT_FOUND: the decode worker dropped the reservation (its transfer deadline passed).
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                        grpc.StatusCode.NOT_FOUND})
_TRANSPORT = ("failed to connect", "connection refused", "socket closed", "connection reset",
              "goaway")


@dataclass(frozen=True)
class CallFailure:
    """What a failed worker call means. ``unreachable``: it failed in transport (the
    worker is down or hung), not inside the worker, so the worker should be skipped."""

    kind: Failure
    code: grpc.StatusCode
    details: str
    unreachable: bool

    def __str__(self) -> str:
        return f"{self.code.name} {self.details}"


def classify(exc: grpc.aio.AioRpcError, *, deadline_passed: bool) -> CallFailure:
    """The one reading of a worker call's error. A ``DEADLINE_EXCEEDED`` is the request's
    own deadline only when it has passed (``deadline_passed``); else the call's shorter
    cap expired on a hung worker, which is worth a retry elsewhere."""
    code, details = exc.code(), exc.details() or ""
    lowered = details.lower()
    unreachable = code == grpc.StatusCode.DEADLINE_EXCEEDED or (
        code == grpc.StatusCode.UNAVAILABLE and any(s in lowered for s in _TRANSPORT))
    if code == grpc.StatusCode.ALREADY_EXISTS:
        kind = Failure.ALREADY_EXISTS
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in lowered:
        kind = Failure.REFUSED  # a message over a size limit is no "busy": it never fits
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and is_queue_refusal(details):
        kind = Failure.QUEUED
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        kind = Failure.BUSY
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        kind = Failure.DEADLINE if deadline_passed else Failure.RETRY
    elif code in _RETRYABLE:
        kind = Failure.RETRY
    else:
        kind = Failure.REFUSED
    return CallFailure(kind, code, details, unreachable)


class WorkerCalls:
    """The internal API calls of one request (its id and sampling converted once). Every
    call names an attempt (``attempt_id``): what the workers key everything by; the
    client's request id goes along for their logs (``client_request_id``), and the
    attempt's lease for the workers to watch. ``lease_ttl_ms`` is the leases'."""

    def __init__(self, pool: WorkerPool, request: ValidRequest, lease_ttl_ms: int) -> None:
        self._pool = pool
        self._req = request
        self._sampling = _sampling_proto(request)
        self._lease_ttl_ms = lease_ttl_ms
        self._prompt: list[int] = list(request.prompt_token_ids)
        self._num_resumed = 0

    def resume(self, sent: tuple[int, ...]) -> None:
        """Later attempts continue the stream after ``sent``, the tokens the client has
        (a migration): their prompt is the request's and ``sent``, the last
        ``len(sent)`` marked as resumed output (``num_resumed_tokens``)."""
        self._prompt = [*self._req.prompt_token_ids, *sent]
        self._num_resumed = len(sent)

    @property
    def num_resumed(self) -> int:
        """Tokens the client has before this attempt's first (0 unless a migration or a
        resumed stream)."""
        return self._num_resumed

    def _lease(self, lease: Lease) -> pb.Lease:
        return pb.Lease(key=lease.key, ttl_ms=self._lease_ttl_ms if lease.key else 0)

    def start_reserve(self, decode_id: str, attempt_id: str, lease: Lease, transfer_id: int,
                      timeout_s: float, wait_s: float,
                      expected_cached_blocks: int | None = None) -> grpc.aio.UnaryUnaryCall:
        """The Reserve call for the attempt on ``decode_id`` (``KeyError`` if it left the
        registry; awaiting it raises ``AioRpcError`` if it failed); its transfer may wait
        ``wait_s`` to start; ``expected_cached_blocks``: its Prefill went out ahead,
        skipping that many blocks. ``reserved`` reads the reply."""
        stub = pb_grpc.DecodeWorkerStub(self._pool.channel(decode_id))
        request = pb.ReserveRequest(
            client_request_id=self._req.request_id, prompt_token_ids=self._prompt,
            num_resumed_tokens=self._num_resumed,
            sampling=self._sampling, transfer_id=transfer_id,
            wait_ms=max(1, int(wait_s * 1000)), attempt_id=attempt_id,
            lease=self._lease(lease))
        if expected_cached_blocks is not None:
            request.expected_cached_blocks = expected_cached_blocks
        return stub.Reserve(request, timeout=timeout_s)

    @staticmethod
    def reserved(reply: pb.ReserveResponse) -> Reservation:
        if not reply.accepted:
            return Reservation(False, reason=reply.reason)
        t = reply.target
        return Reservation(True, reply.num_blocks, KVTarget(
            t.transfer_id, t.kv_address, t.tensor_parallel_size, t.num_cached_blocks))

    def start_prefill(self, prefill_id: str, attempt_id: str, lease: Lease, target: KVTarget,
                      timeout_s: float, moved_from: str = "", max_queued_tokens: int = 0
                      ) -> grpc.aio.UnaryUnaryCall:
        """The attempt's Prefill (``moved_from``: a planned move of that parked attempt's
        KV, ``cluster.moves``; ``max_queued_tokens``: refused if the worker has more to
        compute, ``cluster.prefill_queue``)."""
        stub = pb_grpc.PrefillWorkerStub(self._pool.channel(prefill_id))
        return stub.Prefill(pb.PrefillRequest(
            client_request_id=self._req.request_id, prompt_token_ids=self._prompt,
            num_resumed_tokens=self._num_resumed,
            sampling=self._sampling, target=pb.KVTarget(
                kv_address=target.kv_address, tensor_parallel_size=target.tensor_parallel_size,
                transfer_id=target.transfer_id, num_cached_blocks=target.num_cached_blocks),
            attempt_id=attempt_id, moved_from=moved_from, max_queued_tokens=max_queued_tokens,
            lease=self._lease(lease)), timeout=timeout_s)

    @staticmethod
    def prefilled(reply: pb.PrefillResponse) -> Prefilled:
        times = None
        if reply.HasField("timings"):
            t = reply.timings
            times = PrefillTimes(t.queue_us / 1e6, t.compute_us / 1e6, t.transfer_us / 1e6)
        return Prefilled(reply.first_token_id, reply.num_cached_tokens, reply.num_prompt_tokens,
                         times, _logprobs(reply.first_token_logprobs)
                         if reply.HasField("first_token_logprobs") else None,
                         tuple(_logprobs(m) for m in reply.prompt_logprobs),
                         reply.prefill_tokens_per_s)

    def start_generate(self, decode_id: str, attempt_id: str, lease: Lease, timeout_s: float
                       ) -> grpc.aio.UnaryStreamCall:
        """The reservation's Generate stream, opened alongside the Prefill: the first token
        and cached-token count come to the decode worker with the KV. (``lease``: the
        Reserve named it already.)"""
        stub = pb_grpc.DecodeWorkerStub(self._pool.channel(decode_id))
        return stub.Generate(pb.GenerateRequest(
            client_request_id=self._req.request_id, attempt_id=attempt_id), timeout=timeout_s)

    def start_generate_local(self, decode_id: str, attempt_id: str, lease: Lease,
                             timeout_s: float) -> grpc.aio.UnaryStreamCall:
        stub = pb_grpc.DecodeWorkerStub(self._pool.channel(decode_id))
        return stub.GenerateLocal(pb.GenerateLocalRequest(
            client_request_id=self._req.request_id, prompt_token_ids=self._prompt,
            num_resumed_tokens=self._num_resumed,
            sampling=self._sampling, attempt_id=attempt_id, lease=self._lease(lease)),
            timeout=timeout_s)

    def start_abort(self, worker_id: str, role: str, attempt_id: str
                    ) -> grpc.aio.UnaryUnaryCall | None:
        """``Abort(attempt_id)`` started on the worker; None if it left the registry."""
        try:
            channel = self._pool.channel(worker_id)
        except KeyError:
            return None
        stub: pb_grpc.DecodeWorkerStub | pb_grpc.PrefillWorkerStub = (
            pb_grpc.DecodeWorkerStub(channel) if role == "decode"
            else pb_grpc.PrefillWorkerStub(channel))
        return stub.Abort(pb.AbortRequest(client_request_id=self._req.request_id,
                                          attempt_id=attempt_id), timeout=ABORT_TIMEOUT_S)


@dataclass(frozen=True)
class KVSnapshot:
    """What a worker's prefix cache held at its KV event batch ``seq`` of ``epoch``."""

    epoch: int
    seq: int
    block_hashes: list[bytes]


async def kv_snapshot(channel: grpc.aio.Channel, role: str, timeout_s: float) -> KVSnapshot:
    """The worker's ``KVSnapshot`` (one with no KV events gives an empty one of epoch 0);
    ``BadEvent`` when its hashes are garbled, ``AioRpcError`` when the call fails."""
    stub = (pb_grpc.PrefillWorkerStub(channel) if role == "prefill"
            else pb_grpc.DecodeWorkerStub(channel))
    reply = await stub.KVSnapshot(pb.KVSnapshotRequest(), timeout=timeout_s)
    return KVSnapshot(reply.epoch, reply.seq, unpack_hashes(reply.block_hashes))


async def chunks(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[OutputChunk]:
    """A Generate stream's messages as ``OutputChunk``s."""
    async for message in call:
        yield _chunk(message)


def _sampling_proto(request: ValidRequest) -> pb.SamplingParams:
    p = request.sampling
    message = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                                top_p=p.top_p, top_k=p.top_k, stop=p.stop,
                                stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
                                min_p=p.min_p, min_tokens=p.min_tokens,
                                presence_penalty=p.presence_penalty,
                                frequency_penalty=p.frequency_penalty,
                                repetition_penalty=p.repetition_penalty,
                                logit_bias=dict(p.logit_bias))
    if p.seed is not None:
        message.seed = p.seed
    if p.logprobs is not None:
        message.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        message.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        message.structured.kind = p.structured.kind
        message.structured.spec = p.structured.spec
    return message


def _chunk(message: pb.TokenChunk) -> OutputChunk:
    worker_s = (message.timings.first_chunk_us / 1e6 if message.HasField("timings")
                else None)
    logprobs = tuple(_logprobs(m) for m in message.logprobs)
    prompt_logprobs = tuple(_logprobs(m) for m in message.prompt_logprobs)
    if not message.finish_reason:
        return OutputChunk(tuple(message.token_ids), message.text, worker_s=worker_s,
                           logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    usage = message.usage
    return OutputChunk(tuple(message.token_ids), message.text, message.finish_reason,
                       Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens),
                       worker_s, logprobs, prompt_logprobs=prompt_logprobs)


def _logprobs(message: pb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(message.token_id, message.logprob, message.rank,
                         tuple(zip(message.top_token_ids, message.top_logprobs, strict=True)))
