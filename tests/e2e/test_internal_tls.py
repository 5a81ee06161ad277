"""Mutual TLS on the internal gRPC plane through real processes: Redis, a prefill and a
decode worker and a router, all given ``--internal-tls-*`` (one CA) and the cluster token.

Requests are served; a worker answers no plaintext call, nor a TLS call without a client
certificate the CA signed; with one (and the token) it answers, and ends holding nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.internal.v1 import worker_pb2 as wpb
from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
from cluster.token import CLUSTER_TOKEN_ENV
from deploy.redis_server import RedisServer
from pdserve.client import Client
from tests.auth import with_token
from tests.e2e.cluster import WORKER_FLAGS
from tests.factories import PROMPTS
from tests.processes import Proc, spawn, stop_all
from tests.tls import make_certificates
from tests.worker.procs import assert_idle

pytestmark = pytest.mark.timeout(300)

TOKEN = "internal-tls-token-0123456789"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def mtls_cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[list[Proc], Path]]:
    tmp = tmp_path_factory.mktemp("mtls")
    cert, key, ca = make_certificates(tmp)
    ca_path = tmp / "ca.pem"
    ca_path.write_bytes(ca)
    tls = ("--internal-tls-cert", str(cert), "--internal-tls-key", str(key),
           "--internal-tls-ca", str(ca_path))
    env = {CLUSTER_TOKEN_ENV: TOKEN}
    redis = RedisServer(start_timeout_s=10.0).start()
    procs: list[Proc] = []
    try:
        for role in ("decode", "prefill"):
            procs.append(spawn(role, [role, "--model", str(llama_dir), "--redis-url", redis.url,
                                      "--worker-id", f"{role}-0", *WORKER_FLAGS, *tls],
                               tmp, env))
        for proc in procs:
            proc.wait_ready()
        router = spawn("router", ["router", "--model", str(llama_dir), "--port", "0",
                                  "--no-http", "--redis-url", redis.url, *tls], tmp, env)
        procs.append(router.wait_ready())
        yield procs, tmp
    finally:
        stop_all(procs)
        redis.stop()


def _secure(address: str, tmp: Path, with_client_cert: bool) -> grpc.Channel:
    ca = (tmp / "ca.pem").read_bytes()
    if with_client_cert:
        credentials = grpc.ssl_channel_credentials(
            ca, (tmp / "server.key").read_bytes(), (tmp / "server.pem").read_bytes())
    else:
        credentials = grpc.ssl_channel_credentials(ca)
    return grpc.secure_channel(address, credentials)


def test_requests_are_served_and_workers_answer_only_mutual_tls(
        mtls_cluster: tuple[list[Proc], Path]) -> None:
    procs, tmp = mtls_cluster
    decode, _, router = procs
    with Client(router.address) as client:
        done = client.complete(PROMPTS[3], max_tokens=5, ignore_eos=True, temperature=0,
                               timeout=TIMEOUT_S)
    assert len(done.token_ids) == 5
    for channel in (grpc.insecure_channel(decode.address),
                    _secure(decode.address, tmp, with_client_cert=False)):
        with channel:
            stub = wpb_grpc.DecodeWorkerStub(with_token(channel, TOKEN))
            with pytest.raises(grpc.RpcError) as caught:
                stub.Info(wpb.InfoRequest(), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    for worker in procs[:2]:
        with _secure(worker.address, tmp, with_client_cert=True) as channel:
            kind = (wpb_grpc.DecodeWorkerStub if worker.ready["role"] == "decode"
                    else wpb_grpc.PrefillWorkerStub)
            assert_idle(kind(with_token(channel, TOKEN)))
