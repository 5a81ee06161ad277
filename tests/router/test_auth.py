"""API-key authentication and TLS through real router processes (RELIABILITY rows 35
and 36): without the key or with a wrong one every call is UNAUTHENTICATED (before any
work: this router has no workers, so an authorized Generate gets as far as
UNAVAILABLE); health checks and reflection need no key; the key never appears in the
router's log; a TLS router is reached only by clients that trust its CA."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.redis_server import RedisServer
from pdserve.client import Client, PdserveError
from tests.processes import Proc, spawn

pytestmark = pytest.mark.timeout(120)

KEY = "s3cret-key-for-tests"
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def router(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("auth")
    key_file = tmp / "api-key"
    key_file.write_text(KEY + "\n")
    os.chmod(key_file, 0o600)
    with RedisServer(start_timeout_s=10.0) as redis:
        proc = spawn("router", ["router", "--model", str(llama_dir), "--port", "0",
                                "--redis-url", redis.url, "--api-key-file", str(key_file)],
                     tmp).wait_ready()
        try:
            yield proc
        finally:
            assert proc.stop(signal.SIGTERM) == 0, proc.log_tail()


@pytest.mark.parametrize("api_key", [None, "wrong", KEY + "x"])
def test_missing_or_wrong_key_is_unauthenticated(router: Proc, api_key: str | None) -> None:
    with Client(router.address, api_key=api_key) as client:
        for call in (lambda: client.model_info(timeout=TIMEOUT_S),
                     lambda: client.complete("hello", max_tokens=2, timeout=TIMEOUT_S)):
            with pytest.raises(PdserveError) as excinfo:
                call()
            assert excinfo.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert KEY not in str(excinfo.value)


def test_the_right_key_is_let_through(router: Proc) -> None:
    with Client(router.address, api_key=KEY) as client:
        assert client.model_info(timeout=TIMEOUT_S).vocab_size == 704
        with pytest.raises(PdserveError) as excinfo:  # authorized; no worker to serve it
            client.complete("hello", max_tokens=2, timeout=TIMEOUT_S)
        assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE


def test_health_and_reflection_need_no_key(router: Proc) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(router.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no workers
        assert "pdserve.v1.Generation" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_the_key_is_never_logged(router: Proc) -> None:
    log = router.log_tail(1_000_000)
    assert "API key required" in log and KEY not in log


def test_tls_public_port(llama_dir: Path, tmp_path: Path) -> None:
    # the router serves TLS; a client trusting the CA gets through (with the key), a
    # plaintext client does not, and neither does a client trusting another CA; health
    # alone answers in plaintext on --health-port (for probes), without the key
    from tests.tls import make_certificates

    cert, key, ca = make_certificates(tmp_path)
    (tmp_path / "other").mkdir()
    _, _, other_ca = make_certificates(tmp_path / "other")
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY)
    with RedisServer(start_timeout_s=10.0) as redis:
        proc = spawn("router-tls", ["router", "--model", str(llama_dir), "--port", "0",
                                    "--redis-url", redis.url, "--api-key-file", str(key_file),
                                    "--tls-cert", str(cert), "--tls-key", str(key),
                                    "--health-port", "0"],
                     tmp_path).wait_ready()
        try:
            with Client(proc.address, api_key=KEY, root_certificates=ca) as client:
                assert client.model_info(timeout=TIMEOUT_S).vocab_size == 704
            with grpc.insecure_channel(proc.ready["health_address"]) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no worker
                with pytest.raises(grpc.RpcError) as refused:  # nothing else is served there
                    grpc_generic_call(channel)
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            for kwargs in ({}, {"root_certificates": other_ca}):
                with Client(proc.address, api_key=KEY, **kwargs) as client:  # type: ignore[arg-type]
                    with pytest.raises(PdserveError) as excinfo:
                        client.model_info(timeout=5.0)
                    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            assert proc.stop(signal.SIGTERM) == 0, proc.log_tail()
    assert "TLS on the public port" in proc.log_tail()


def grpc_generic_call(channel: grpc.Channel) -> None:
    """A ``GetModelInfo`` call on ``channel`` (raises its ``RpcError``)."""
    from pdserve.v1 import generate_pb2, generate_pb2_grpc

    generate_pb2_grpc.GenerationStub(channel).GetModelInfo(generate_pb2.ModelInfoRequest(),
                                                           timeout=TIMEOUT_S)
