"""The authenticated internal plane through real processes: every process of this cluster
has the cluster token (``$PDSERVE_CLUSTER_TOKEN``, two tokens: rotation under way).

- requests are served end to end (the router's calls carry the token; the KV moves over
  authenticated channels);
- an internal call without the token, or with another, is refused UNAUTHENTICATED before
  it does anything; health checks stay open;
- a router or a worker started without the token is refused at start with a message
  naming what to give, also after Redis lost its data (the router marks the cluster
  again); a router that sends the other of the two tokens is served;
- the debug port listens on loopback even when ``--host`` is a wildcard, and requires the
  API key when one is set.
"""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.internal.v1 import worker_pb2 as wpb
from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
from cluster.token import CLUSTER_TOKEN_ENV, TOKEN_METADATA
from pdserve.client import Client
from tests.e2e.cluster import Cluster
from tests.factories import PROMPTS, REPO_ROOT
from tests.processes import spawn, wait_until

pytestmark = pytest.mark.timeout(300)

OLD, NEW = "old-token-0123456789abcdef", "new-token-fedcba9876543210"
TIMEOUT_S = 60.0

CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1,
           "env": {CLUSTER_TOKEN_ENV: f"{OLD},{NEW}"}}


def test_requests_are_served_over_the_authenticated_plane(client: Client) -> None:
    done = client.complete(PROMPTS[3], max_tokens=6, temperature=0, ignore_eos=True,
                           timeout=TIMEOUT_S)
    assert len(done.token_ids) == 6


@pytest.mark.parametrize("metadata", [None, ((TOKEN_METADATA, "not-the-token-0123456789"),)],
                         ids=["without", "another"])
def test_an_internal_call_without_the_token_is_refused(
        cluster: Cluster, metadata: tuple[tuple[str, str], ...] | None) -> None:
    decode = cluster.decode[0]
    stub = wpb_grpc.DecodeWorkerStub(decode.channel)
    for call in (lambda: stub.Info(wpb.InfoRequest(), timeout=10, metadata=metadata),
                 lambda: stub.Abort(wpb.AbortRequest(attempt_id="r-1"), timeout=10,
                                    metadata=metadata),
                 lambda: list(stub.Generate(wpb.GenerateRequest(attempt_id="r-1"), timeout=10,
                                            metadata=metadata))):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "cluster token" in (caught.value.details() or "")
    # with either token it answers; health needs none
    for token in (OLD, NEW):
        info = stub.Info(wpb.InfoRequest(), timeout=10, metadata=((TOKEN_METADATA, token),))
        assert info.worker_id == decode.name
    health = health_pb2_grpc.HealthStub(decode.channel).Check(
        health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def _refused_at_start(cluster: Cluster, command: list[str]) -> str:
    """Run a server without the token; its exit code and output."""
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", *command, "--model", str(cluster.model_dir),
         "--redis-url", cluster.redis.url], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120, env={k: v for k, v in __import__("os").environ.items()
                          if k != CLUSTER_TOKEN_ENV})
    assert result.returncode != 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_a_router_or_worker_without_the_token_is_refused_at_start(cluster: Cluster) -> None:
    for command in (["router", "--port", "0", "--no-http"], ["decode", "--worker-id", "d-x"]):
        output = _refused_at_start(cluster, command)
        assert "requires the cluster token" in output, output
        assert "--cluster-token-file" in output


def test_a_router_sending_the_other_token_is_served(cluster: Cluster) -> None:
    other = cluster.start_router("--no-http", name="router-new",
                                 env={CLUSTER_TOKEN_ENV: f"{NEW}\n{OLD}"})
    try:
        with Client(other.address) as client:
            done = client.complete(PROMPTS[0], max_tokens=4, ignore_eos=True,
                                   timeout=TIMEOUT_S)
        assert len(done.token_ids) == 4
    finally:
        assert other.stop() == 0, other.log_tail()


def test_the_debug_port_is_loopback_and_needs_the_api_key(cluster: Cluster,
                                                          tmp_path: object) -> None:
    key_file = cluster.tmp / "api.key"
    key_file.write_text("debug-s3cret\n")
    router = spawn("router-debug", [
        "router", "--model", str(cluster.model_dir), "--host", "0.0.0.0", "--port", "0",
        "--no-http", "--redis-url", cluster.redis.url, "--debug-port", "0",
        "--api-key-file", str(key_file)], cluster.tmp, dict(cluster.env))
    try:
        router.wait_ready()
        address = router.ready["debug_address"]
        assert address.startswith("127.0.0.1:"), address
        with grpc.insecure_channel(address) as channel:
            stub = wpb_grpc.RouterDebugStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Holdings(wpb.InfoRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            held = stub.Holdings(wpb.InfoRequest(), timeout=10,
                                 metadata=(("authorization", "Bearer debug-s3cret"),))
            assert held.router_id
    finally:
        assert router.stop() == 0, router.log_tail()


def test_the_routers_mark_the_cluster_again_after_redis_lost_its_data(
        cluster: Cluster) -> None:
    # (last: it empties Redis) the mark a worker without the token is refused by is
    # written again by the router into the restarted Redis, so such a worker still
    # cannot join
    cluster.redis.restart()
    client = redis.Redis.from_url(cluster.redis.url)
    try:
        wait_until(lambda: bool(client.keys("*token_required")), 30.0,
                   "the router to mark the cluster as requiring the token again")
    finally:
        client.close()
    output = _refused_at_start(cluster, ["decode", "--worker-id", "d-y"])
    assert "requires the cluster token" in output, output
    # deleted from a running Redis (to run without a token again), it stays deleted
    client = redis.Redis.from_url(cluster.redis.url)
    try:
        assert client.delete(*client.keys("*token_required")) == 1
        time.sleep(2.0)  # four of the router's refreshes
        assert not client.keys("*token_required")
    finally:
        client.close()
