"""Issue 11, defect 3: the first KV transfer to a decode worker the prefill worker has not
sent to before looks its KV endpoint up off the engine thread. When that decode worker
hangs (SIGSTOP) right after accepting a reservation, the prefill worker's engine step does
not block on it: other requests prefill and transfer at their normal pace, and ``Info``
answers at once. Real processes: Redis, one prefill worker, two decode workers; the
test drives the workers' internal API itself (no router), then frees what it reserved
and runs the leak check.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from cluster.internal.v1 import worker_pb2 as wpb
from tests.e2e.cluster import Cluster
from tests.worker import calls

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
FAST_S = 10.0  # well below the 30 s a blocked endpoint lookup used to hold the step
SAMPLING = wpb.SamplingParams(max_tokens=4, temperature=0, top_p=1.0, top_k=-1)


CLUSTER = {"num_prefill": 1, "num_decode": 2, "decode_tp": 1}


def _reserve(cluster: Cluster, decode: int, attempt: str, prompt: list[int],
             transfer_id: int) -> wpb.KVTarget:
    reply = calls.reserve(cluster.stub(cluster.decode[decode]), attempt, prompt, SAMPLING,
                          transfer_id, wait_ms=int(TIMEOUT_S * 1000), timeout_s=TIMEOUT_S)
    assert reply.accepted, reply
    return reply.target


def _prefill(cluster: Cluster, attempt: str, prompt: list[int],
             target: wpb.KVTarget) -> wpb.PrefillResponse:
    reply: wpb.PrefillResponse = cluster.stub(cluster.prefill[0]).Prefill(  # type: ignore[union-attr]
        calls.prefill_request(attempt, prompt, SAMPLING, target), timeout=TIMEOUT_S)
    return reply


def test_a_new_decode_worker_that_hangs_never_blocks_the_prefill_step(
        cluster: Cluster) -> None:
    hung, healthy = cluster.decode[1], cluster.decode[0]
    to_hung = [17 + i % 300 for i in range(48)]
    target = _reserve(cluster, 1, "to-hung", to_hung, 7001)
    hung.proc.send_signal(signal.SIGSTOP)  # it accepted the reservation, then hangs
    outcome: list[object] = []

    def send_to_hung() -> None:
        try:
            outcome.append(_prefill(cluster, "to-hung", to_hung, target))
        except grpc.RpcError as exc:
            outcome.append(exc.code())  # type: ignore[attr-defined]

    thread = threading.Thread(target=send_to_hung, daemon=True)
    try:
        thread.start()
        time.sleep(1.0)  # its transfer is looking up the hung worker's endpoint
        # the prefill worker answers Info at once, and a request to the healthy decode
        # worker is prefilled and its KV delivered at the normal pace
        start = time.monotonic()
        info = cluster.info(cluster.prefill[0])
        assert time.monotonic() - start < 5.0  # not the 30 s a blocked lookup held it
        assert "to-hung" in info.attempt_ids
        for i in range(3):
            prompt = [23 + (7 * i + j) % 300 for j in range(48)]
            start = time.monotonic()
            reply = _prefill(cluster, f"healthy-{i}", prompt,
                             _reserve(cluster, 0, f"healthy-{i}", prompt, 7100 + i))
            took = time.monotonic() - start
            assert reply.num_prompt_tokens == len(prompt)
            assert took < FAST_S, f"a Prefill to the healthy decode worker took {took:.1f}s"
            assert not outcome, outcome  # the hung one is still in flight meanwhile
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    thread.join(TIMEOUT_S + 5)
    assert outcome, "the Prefill to the hung worker never ended"
    for i in range(3):  # nobody will ask for their streams: free the reservations
        healthy_stub = cluster.stub(healthy)
        healthy_stub.Abort(wpb.AbortRequest(client_request_id=f"healthy-{i}",
                                            attempt_id=f"healthy-{i}"), timeout=TIMEOUT_S)
    cluster.stub(hung).Abort(wpb.AbortRequest(client_request_id="to-hung", attempt_id="to-hung"),
                             timeout=TIMEOUT_S)
    cluster.assert_no_leaks()
