"""One rank of a tensor-parallel worker dies (RELIABILITY row 9), through real processes.

Decode: the request it was streaming fails with UNAVAILABLE after the tokens already sent
(never a silent end), and so does — at once, not at its deadline — every other request the
worker held: one reserved and waiting for its KV with a Generate stream open; the worker
reports NOT_SERVING and the router stops routing to it; its surviving leader does not hang
(it answers and stops on SIGTERM), and the prefill worker frees everything. Prefill: the
Prefill calls it held (queued and computing) fail at once, and the worker reports
NOT_SERVING.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.internal.v1 import worker_pb2 as wpb
from pdserve.client import Client, PdserveError
from tests.e2e.cluster import Cluster, start_cluster
from tests.processes import Proc, children, listening, wait_until

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
FAST_S = 15.0  # "at once": well before any request's 60 s deadline
SAMPLING = wpb.SamplingParams(max_tokens=8, temperature=0, top_p=1.0, top_k=-1)


CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 2}


def _is_rank(pid: int) -> bool:
    """A tensor-parallel follower rank (``python -m engine.tp.rank_main``)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"engine.tp.rank_main" in cmdline


def _assert_binds_loopback_only(proc: Proc, follower: int) -> None:
    """Row 36 for a TP group: the leader and its follower rank (the TP group's gloo
    sockets, the KV rendezvous) listen on 127.0.0.1 only."""
    seen = {pid: listening(pid) for pid in (proc.proc.pid, follower)}
    assert all(seen.values()), seen  # both listen on something
    assert all(a.startswith("127.0.0.1:") for addresses in seen.values() for a in addresses), seen


def _follower_rank(proc: Proc) -> int:
    ranks = [pid for pid in children(proc.proc.pid) if _is_rank(pid)]
    assert len(ranks) == 1, ranks  # TP 2: the leader's one follower
    return ranks[0]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status)


def _waiting_generate(cluster: Cluster, results: dict[str, object]) -> threading.Thread:
    """A reservation on the decode worker whose KV never comes, its Generate stream open."""
    stub = cluster.stub(cluster.decode[0])
    reply = stub.Reserve(wpb.ReserveRequest(client_request_id="reserved", attempt_id="reserved", prompt_token_ids=[7] * 40,
                                            sampling=SAMPLING, transfer_id=424242,
                                            wait_ms=int(TIMEOUT_S * 1000)), timeout=TIMEOUT_S)
    assert reply.accepted, reply

    def generate() -> None:
        start = time.monotonic()
        try:
            list(stub.Generate(wpb.GenerateRequest(client_request_id="reserved", attempt_id="reserved"), timeout=TIMEOUT_S))
            results["reserved"] = "finished?!"
        except grpc.RpcError as exc:
            results["reserved"] = (exc.code(), time.monotonic() - start)  # type: ignore[attr-defined]

    thread = threading.Thread(target=generate)
    thread.start()
    return thread


def test_a_dead_decode_rank_fails_every_request_it_held(cluster: Cluster) -> None:
    decode = cluster.decode[0]
    follower = _follower_rank(decode)
    _assert_binds_loopback_only(decode, follower)
    results: dict[str, object] = {}
    with Client(cluster.address) as client:
        stream = client.generate("rank death " * 4, max_tokens=900, ignore_eos=True,
                                 timeout=TIMEOUT_S)
        received = list(next(stream).token_ids)
        waiting = _waiting_generate(cluster, results)
        time.sleep(0.5)  # its stream is open and waits for the KV
        killed_at = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        # 1. the streaming request: UNAVAILABLE after the tokens already sent
        with pytest.raises(PdserveError) as excinfo:
            for chunk in stream:
                received += chunk.token_ids
        assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE, excinfo.value
        assert len(received) < 900
        # 2. the reserved one: failed at once (UNAVAILABLE), not held until its deadline
        waiting.join(TIMEOUT_S)
        code, _ = results["reserved"]  # type: ignore[misc]
        assert code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - killed_at < FAST_S
        # 3. the worker says it cannot serve, and the router stops routing to it
        wait_until(lambda: _health(decode.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                   30.0, "the decode worker to report NOT_SERVING")
        with pytest.raises(PdserveError) as excinfo:
            client.complete("after the rank died", max_tokens=2, timeout=TIMEOUT_S)
        assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    # the surviving leader does not hang: it answers at once that its engine is gone,
    # and stops on SIGTERM
    with pytest.raises(grpc.RpcError) as info:
        cluster.info(decode)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "engine loop is not running" in (info.value.details() or "")  # type: ignore[attr-defined]
    cluster.assert_no_leaks(cluster.prefill)
    decode.stop(signal.SIGTERM)
    assert decode.proc.returncode is not None and decode.proc.returncode != -signal.SIGKILL, \
        decode.log_tail()


@pytest.fixture(scope="module")
def tp2_prefill(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with start_cluster(llama_dir, tmp_path_factory.mktemp("prefill-rank-death"), num_prefill=1,
                           num_decode=1, decode_tp=1, prefill_args=("--tensor-parallel-size", "2"),
                           decode_kv_blocks=256) as c:  # six 300-token reservations at once
        yield c


def test_a_dead_prefill_rank_fails_every_prefill_it_held(tp2_prefill: Cluster) -> None:
    cluster, (prefill,) = tp2_prefill, tp2_prefill.prefill
    decode = cluster.stub(cluster.decode[0])
    prefill_stub = cluster.stub(prefill)
    outcomes: list[tuple[object, float]] = []

    def prefill_call(i: int) -> None:
        rid = f"held-{i}"
        reply = decode.Reserve(wpb.ReserveRequest(
            client_request_id=rid, attempt_id=rid, prompt_token_ids=[11 + i] * 300, sampling=SAMPLING,
            transfer_id=9000 + i, wait_ms=int(TIMEOUT_S * 1000)), timeout=TIMEOUT_S)
        assert reply.accepted, reply
        start = time.monotonic()
        try:
            prefill_stub.Prefill(wpb.PrefillRequest(  # type: ignore[union-attr]
                client_request_id=rid, attempt_id=rid, prompt_token_ids=[11 + i] * 300, sampling=SAMPLING,
                target=reply.target), timeout=TIMEOUT_S)
            outcomes.append(("done", time.monotonic() - start))
        except grpc.RpcError as exc:
            outcomes.append((exc.code(), time.monotonic() - start))  # type: ignore[attr-defined]

    follower = _follower_rank(prefill)
    _assert_binds_loopback_only(prefill, follower)
    threads = [threading.Thread(target=prefill_call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    wait_until(lambda: cluster.info(prefill).waiting_requests + cluster.info(prefill)
               .running_requests >= 2, 30.0, "prefills queued on the prefill worker")
    killed_at = time.monotonic()
    os.kill(follower, signal.SIGKILL)
    for t in threads:
        t.join(TIMEOUT_S)
    assert len(outcomes) == len(threads), outcomes  # every reservation was accepted
    failed = [o for o in outcomes if o[0] != "done"]
    assert failed and all(code == grpc.StatusCode.UNAVAILABLE for code, _ in failed), outcomes
    assert time.monotonic() - killed_at < FAST_S, outcomes
    wait_until(lambda: _health(prefill.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
               30.0, "the prefill worker to report NOT_SERVING")
    for i in range(6):  # what the router would do: abort the attempts on the decode side
        decode.Abort(wpb.AbortRequest(client_request_id=f"held-{i}", attempt_id=f"held-{i}"),
                     timeout=TIMEOUT_S)
    cluster.assert_no_leaks(cluster.decode)
    prefill.stop()  # it cannot serve again; the whole cluster's leak check follows
