"""One rank of a tensor-parallel decode worker dies (RELIABILITY row 9), through real
processes: the request it was streaming fails with UNAVAILABLE after the tokens already
sent (never a silent end), the worker reports NOT_SERVING and the router stops routing
to it, its surviving leader does not hang (it still answers and stops on SIGTERM), and
the prefill worker frees everything."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import Client, PdserveError
from tests.processes import children, wait_until
from tests.router.cluster import Cluster, start_cluster

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(llama_dir, tmp_path_factory.mktemp("rank-death"), num_prefill=1,
                      num_decode=1, decode_tp=2)
    try:
        yield c
    finally:
        c.close()


def _follower_rank(pid: int) -> int:
    ranks = [c for c in children(pid)
             if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(ranks) == 1, ranks
    return ranks[0]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S).status)


def test_a_dead_decode_rank_fails_its_requests_and_the_worker(cluster: Cluster) -> None:
    decode = cluster.decode[0]
    follower = _follower_rank(decode.proc.pid)
    with Client(cluster.address) as client:
        stream = client.generate("rank death " * 4, max_tokens=900, ignore_eos=True,
                                 timeout=TIMEOUT_S)
        received = list(next(stream).token_ids)
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(PdserveError) as excinfo:
            for chunk in stream:
                received += chunk.token_ids
        assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE, excinfo.value
        assert len(received) < 900
        # the worker says it cannot serve, and the router stops routing to it
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
