"""The internal API's calls as tests make them by hand (once for every test that plays the
router's part): Reserve, the Prefill request, Generate, Abort and Info, each naming its
attempt (the client's request id defaults to the attempt id)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.internal.v1 import worker_pb2 as pb
from tests.worker.procs import RPC_TIMEOUT_S


def reserve(stub: Any, attempt_id: str, prompt: Sequence[int], sampling: pb.SamplingParams,
            transfer_id: int, *, client_request_id: str | None = None, wait_ms: int = 0,
            timeout_s: float = RPC_TIMEOUT_S) -> pb.ReserveResponse:
    """A decode worker's Reserve for ``attempt_id`` (``wait_ms`` 0: its transfer timeout)."""
    reply: pb.ReserveResponse = stub.Reserve(pb.ReserveRequest(
        client_request_id=client_request_id or attempt_id, attempt_id=attempt_id,
        prompt_token_ids=prompt, sampling=sampling, transfer_id=transfer_id, wait_ms=wait_ms),
        timeout=timeout_s)
    return reply


def prefill_request(attempt_id: str, prompt: Sequence[int], sampling: pb.SamplingParams,
                    target: pb.KVTarget, *, client_request_id: str | None = None
                    ) -> pb.PrefillRequest:
    """The Prefill of a reservation (its ``target``), to send as the test needs."""
    return pb.PrefillRequest(client_request_id=client_request_id or attempt_id,
                             attempt_id=attempt_id, prompt_token_ids=prompt, sampling=sampling,
                             target=target)


def generate(stub: Any, attempt_id: str, *, client_request_id: str | None = None,
             timeout_s: float = RPC_TIMEOUT_S) -> list[pb.TokenChunk]:
    """A reservation's whole Generate stream."""
    return list(stub.Generate(pb.GenerateRequest(
        client_request_id=client_request_id or attempt_id, attempt_id=attempt_id),
        timeout=timeout_s))


def tokens(chunks: Sequence[pb.TokenChunk]) -> list[int]:
    """The token ids of a finished stream."""
    assert chunks and chunks[-1].finish_reason, chunks
    return [t for chunk in chunks for t in chunk.token_ids]


def abort(stub: Any, attempt_id: str, *, client_request_id: str | None = None) -> bool:
    """``Abort(attempt_id)``: whether the worker held something for it."""
    return bool(stub.Abort(pb.AbortRequest(client_request_id=client_request_id or attempt_id,
                                           attempt_id=attempt_id), timeout=RPC_TIMEOUT_S).found)


def info(stub: Any) -> pb.WorkerInfo:
    reply: pb.WorkerInfo = stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
    return reply
