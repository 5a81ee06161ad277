"""Attempt ids (issue 11, defects 4 and 5), through real processes: Redis, a prefill and a
decode worker and the router. The tests play the router over the internal API where a
race must be made exact (pause points hold a worker's loop), and go through the router
where a client's behaviour is the point. Every test ends with the whole cluster's leak
check (``Cluster.assert_no_leaks``: workers, the router's holdings, Redis).

- Defect 4: workers key what they hold by attempt id, never the client's request id: two
  attempts of one request id live side by side on a decode worker (so a retry after a
  timed-out Abort is served there), a late Abort or end-of-call of a first Prefill never
  touches the second attempt, and a client that cancels and resubmits under the same id
  through the router is always served.
- Defect 5: a command the engine loop was running when its caller left (deadline) is
  aborted as soon as it ran: a Prefill never computes, a reservation is freed at once,
  not at its transfer deadline.
"""

from __future__ import annotations

import itertools
import secrets
import time

import grpc
import pytest

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.pause_points import PauseDir
from engine import SamplingParams
from pdserve.client import Client
from tests.e2e.cluster import Cluster
from tests.processes import wait_until
from tests.worker import calls
from tests.worker.procs import proto_params

pytestmark = pytest.mark.timeout(300)

RPC_TIMEOUT_S = 30.0
TIMEOUT_S = 60.0
PROMPT = [5 + (11 * i) % 600 for i in range(40)]
PARAMS = proto_params(SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
_transfer_ids = itertools.count((secrets.randbits(32) << 8) + 1)


CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1}


def _d(c: Cluster) -> pb_grpc.DecodeWorkerStub:
    return pb_grpc.DecodeWorkerStub(c.decode[0].channel)


def _p(c: Cluster) -> pb_grpc.PrefillWorkerStub:
    return pb_grpc.PrefillWorkerStub(c.prefill[0].channel)


def _reserve(c: Cluster, rid: str, attempt: str, timeout_s: float = RPC_TIMEOUT_S,
             wait_ms: int = 60_000) -> pb.ReserveResponse:
    return calls.reserve(_d(c), attempt, PROMPT, PARAMS, next(_transfer_ids),
                         client_request_id=rid, wait_ms=wait_ms, timeout_s=timeout_s)


def _prefill_request(rid: str, attempt: str, target: pb.KVTarget) -> pb.PrefillRequest:
    return calls.prefill_request(attempt, PROMPT, PARAMS, target, client_request_id=rid)


def _generate(c: Cluster, rid: str, attempt: str) -> list[int]:
    chunks = calls.generate(_d(c), attempt, client_request_id=rid)
    assert chunks[-1].finish_reason == "length"
    return calls.tokens(chunks)


# ------------------------------------------------------------------------ defect 4

def test_two_attempts_of_one_request_id_live_side_by_side_on_a_decode_worker(
        cluster: Cluster) -> None:
    # 1. attempt 1 reserved; its Abort "timed out" (never arrives): the retry, attempt 2 of
    #    the same request id, reserves on the same decode worker (was ALREADY_EXISTS)
    c, rid = cluster, "reused-id"
    first = _reserve(c, rid, "t4-a1")
    second = _reserve(c, rid, "t4-a2")
    assert first.accepted and second.accepted, (first.reason, second.reason)
    assert set(calls.info(_d(c)).attempt_ids) == {"t4-a1", "t4-a2"}
    # 2. attempt 2 is served end to end
    done = _p(c).Prefill(_prefill_request(rid, "t4-a2", second.target), timeout=RPC_TIMEOUT_S)
    tokens = _generate(c, rid, "t4-a2")
    assert len(tokens) == 6 and tokens[0] == done.first_token_id
    # 3. the late Abort of attempt 1 frees attempt 1 only; attempt 2 is long done
    assert calls.abort(_d(c), "t4-a1")
    assert not calls.abort(_d(c), "t4-a2")


def test_a_late_abort_of_a_first_prefill_never_touches_the_second(cluster: Cluster) -> None:
    c, rid = cluster, "resubmitted"
    pause = PauseDir(c.pause_dir(0))
    targets = [_reserve(c, rid, f"t4-b{k}").target for k in (1, 2)]
    # 1. the first attempt's Prefill starts; the loop is held once it began computing
    pause.arm("prefill.started", attempt_id="t4-b1")
    first = _p(c).Prefill.future(_prefill_request(rid, "t4-b1", targets[0]),
                                 timeout=RPC_TIMEOUT_S)
    pause.wait_paused("prefill.started", 30.0)
    try:
        # 2. its caller leaves (its end-of-call abort queues behind the held loop), the
        #    second attempt's Prefill arrives, then a late Abort of the first attempt
        first.cancel()
        second = _p(c).Prefill.future(_prefill_request(rid, "t4-b2", targets[1]),
                                      timeout=RPC_TIMEOUT_S)
        time.sleep(0.5)  # (Info would queue behind the held loop) the Submit queues first
        late = _p(c).Abort.future(pb.AbortRequest(client_request_id=rid, attempt_id="t4-b1"),
                                  timeout=RPC_TIMEOUT_S)
    finally:
        pause.release("prefill.started")
    # 3. the second attempt is never touched: prefilled and streamed in full
    done = second.result(timeout=RPC_TIMEOUT_S)
    assert late.result(timeout=RPC_TIMEOUT_S) is not None
    assert _generate(c, rid, "t4-b2")[0] == done.first_token_id
    assert first.cancelled()
    assert calls.abort(_d(c), "t4-b1")  # the router's part: the first reservation


def test_cancel_and_resubmit_under_one_request_id_through_the_router(cluster: Cluster) -> None:
    # a client cancels a stream and resubmits at once under the same id, many times: each
    # resubmission is served in full (no "already in flight", no late abort of it)
    with Client(cluster.address) as client:
        for round_ in range(6):
            stream = client.generate("cancel me " * 3, max_tokens=200, ignore_eos=True,
                                     request_id="again", timeout=TIMEOUT_S)
            assert next(stream).token_ids
            stream.close()  # cancels the call
            result = client.complete(f"resubmitted {round_}", max_tokens=5, ignore_eos=True,
                                     request_id="again", timeout=TIMEOUT_S)
            assert len(result.token_ids) == 5 and result.finish_reason == "length"


# ------------------------------------------------------------------------ defect 5

def test_a_prefill_whose_caller_left_while_it_was_submitted_never_computes(
        cluster: Cluster) -> None:
    # (a caller whose deadline passes is covered twice: the queued prefill is dropped at
    # its deadline too; a caller that cancels — the router after a client cancel — is not)
    c, rid = cluster, "left-prefill"
    pause = PauseDir(c.pause_dir(0))
    target = _reserve(c, rid, "t5-p1").target
    started = calls.info(_p(c)).num_started_requests
    # 1. the loop picks up the Submit and is held inside it; the caller cancels
    pause.arm("worker.command", command="Submit", attempt_id="t5-p1")
    call = _p(c).Prefill.future(_prefill_request(rid, "t5-p1", target), timeout=RPC_TIMEOUT_S)
    pause.wait_paused("worker.command", 30.0)
    call.cancel()
    time.sleep(0.5)  # the worker's handler has been cancelled by now
    # 2. released: the Submit completes, and the attempt is aborted before any step
    pause.release("worker.command")
    wait_until(lambda: not calls.info(_p(c)).attempt_ids, 10.0, "the prefill worker to drop it")
    assert calls.info(_p(c)).num_started_requests == started  # never computed
    assert calls.abort(_d(c), "t5-p1")  # the router's part: its reservation


def test_a_reservation_whose_caller_left_while_it_was_made_is_freed_at_once(
        cluster: Cluster) -> None:
    c, rid = cluster, "left-reserve"
    pause = PauseDir(c.pause_dir("decode-0"))
    # 1. the decode loop is held inside the Reserve; its caller's deadline passes (the
    #    reservation itself could wait 60 s for its transfer)
    pause.arm("worker.command", command="Reserve", attempt_id="t5-r1")
    call = _d(c).Reserve.future(pb.ReserveRequest(
        client_request_id=rid, attempt_id="t5-r1", prompt_token_ids=PROMPT, sampling=PARAMS,
        transfer_id=next(_transfer_ids), wait_ms=60_000), timeout=1.0)
    pause.wait_paused("worker.command", 30.0)
    try:
        with pytest.raises(grpc.RpcError) as excinfo:
            call.result(timeout=RPC_TIMEOUT_S)
        # the client's deadline, or the worker's own wait for its loop (given the call's
        # remaining time) — whichever fires first
        assert excinfo.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED or (
            excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
            and "did not answer Reserve" in (excinfo.value.details() or "")), excinfo.value
        time.sleep(0.5)
    finally:
        # 2. released: the reservation is made, then freed at once — not after 60 s
        pause.release("worker.command")
    wait_until(lambda: not calls.info(_d(c)).attempt_ids, 10.0, "the decode worker to free it")
    assert not calls.abort(_d(c), "t5-r1")  # nothing left for the router's Abort
