"""The one reading of a failed worker call (``router.worker_calls.classify``)."""

from __future__ import annotations

import grpc
import pytest

from cluster.prefill_queue import queue_refusal
from router.worker_calls import Failure, classify

S = grpc.StatusCode


def error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(("code", "details", "deadline_passed", "kind", "unreachable"), [
    (S.UNAVAILABLE, "failed to connect to all addresses", False, Failure.RETRY, True),
    (S.UNAVAILABLE, "Socket closed", False, Failure.RETRY, True),
    (S.UNAVAILABLE, "the engine loop is not running", False, Failure.RETRY, False),
    (S.RESOURCE_EXHAUSTED, "busy", False, Failure.BUSY, False),
    # a prefill queue over the Prefill's limit: prefill elsewhere (cluster.prefill_queue)
    (S.RESOURCE_EXHAUSTED, queue_refusal(300, 40), False, Failure.QUEUED, False),
    # a message over a size limit never fits: a refusal, never "busy" (waiting would loop)
    (S.RESOURCE_EXHAUSTED, "Received message larger than max (4194400 vs. 4194304)", False,
     Failure.REFUSED, False),
    (S.NOT_FOUND, "no live reservation", False, Failure.RETRY, False),
    (S.ABORTED, "", False, Failure.RETRY, False),
    (S.INTERNAL, "", False, Failure.RETRY, False),
    (S.CANCELLED, "", False, Failure.RETRY, False),
    # a call's own cap expired on a hung worker: retry elsewhere, and skip the worker
    (S.DEADLINE_EXCEEDED, "Deadline Exceeded", False, Failure.RETRY, True),
    # the request's own deadline: no retry
    (S.DEADLINE_EXCEEDED, "Deadline Exceeded", True, Failure.DEADLINE, True),
    (S.ALREADY_EXISTS, "request r is live here", False, Failure.ALREADY_EXISTS, False),
    (S.INVALID_ARGUMENT, "bad KV target", False, Failure.REFUSED, False),
    (S.FAILED_PRECONDITION, "stream already open", False, Failure.REFUSED, False),
])
def test_every_status_has_one_meaning(code: grpc.StatusCode, details: str,
                                      deadline_passed: bool, kind: Failure,
                                      unreachable: bool) -> None:
    failure = classify(error(code, details), deadline_passed=deadline_passed)
    assert (failure.kind, failure.unreachable) == (kind, unreachable)
    assert str(failure) == f"{code.name} {details}"
