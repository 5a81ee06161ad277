"""Generated protobuf code: committed copies are fresh, and the internal API round-trips.

The staleness test regenerates ``proto/**/*.proto`` into a temporary directory and
compares bytes with the committed modules; it fails until ``python -m tools.protogen``
is run after a ``.proto`` edit.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from tools import protogen

WORKER_PROTO = Path("cluster/internal/v1/worker.proto")
WORKER_MODULES = [Path("cluster/internal/v1") / f"worker{s}" for s in protogen.GENERATED_SUFFIXES]


def make_sampling(**overrides: Any) -> pb.SamplingParams:
    fields: dict[str, Any] = dict(max_tokens=32, temperature=0.7, top_p=0.9, top_k=-1,
                                     stop=["\n\n"], stop_token_ids=[2], ignore_eos=False)
    fields.update(overrides)
    return pb.SamplingParams(**fields)


def copy_checkout(dst: Path) -> Path:
    """``proto/`` and the committed generated modules, as a minimal checkout under ``dst``."""
    shutil.copytree(protogen.REPO_ROOT / "proto", dst / "proto")
    for rel in protogen.committed_outputs(protogen.REPO_ROOT):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(protogen.REPO_ROOT / rel, dst / rel)
    return dst


# --- staleness -----------------------------------------------------------------------------

def test_committed_generated_code_matches_proto() -> None:
    problems = protogen.stale_files()
    assert problems == [], (
        "generated protobuf code is stale; run `python -m tools.protogen` and commit:\n"
        + "\n".join(problems))


def test_worker_proto_outputs_are_committed_at_importable_paths() -> None:
    assert WORKER_PROTO in protogen.proto_files(protogen.REPO_ROOT / "proto")
    assert set(WORKER_MODULES) <= set(protogen.committed_outputs(protogen.REPO_ROOT))
    assert pb.DESCRIPTOR.name == WORKER_PROTO.as_posix()
    assert pb.DESCRIPTOR.package == "pdserve.internal.v1"


def test_check_detects_edit_then_regenerate_fixes_it(tmp_path: Path) -> None:
    # 1. A fresh copy of the checkout is clean.
    repo = copy_checkout(tmp_path)
    assert protogen.stale_files(repo) == []
    # 2. Editing the .proto without regenerating makes the check fail, naming the module.
    proto = repo / "proto" / WORKER_PROTO
    proto.write_text(proto.read_text().replace(
        "message InfoRequest {}", "message InfoRequest { bool verbose = 1; }"))
    assert "differs  cluster/internal/v1/worker_pb2.py" in protogen.stale_files(repo)
    assert protogen.main(["--check", "--repo-root", str(repo)]) == 1
    # 3. Regenerating rewrites the changed modules and the check passes again.
    assert protogen.main(["--repo-root", str(repo)]) == 0
    assert protogen.stale_files(repo) == []


def test_deleted_proto_leaves_orphans_that_regenerate_removes(tmp_path: Path) -> None:
    repo = copy_checkout(tmp_path)
    (repo / "proto" / WORKER_PROTO).unlink()

    assert protogen.stale_files(repo) == [f"orphaned {m}" for m in sorted(WORKER_MODULES)]
    _, removed = protogen.regenerate(repo)
    assert removed == sorted(WORKER_MODULES)
    assert not any((repo / m).exists() for m in WORKER_MODULES)


def test_generate_refuses_a_non_empty_output_dir(tmp_path: Path) -> None:
    (tmp_path / "leftover.txt").write_text("x")
    with pytest.raises(protogen.ProtogenError, match="not empty"):
        protogen.generate(tmp_path, protogen.REPO_ROOT / "proto")


# --- schema --------------------------------------------------------------------------------

def test_field_numbers_are_gap_free_from_one() -> None:
    for name, message in pb.DESCRIPTOR.message_types_by_name.items():
        numbers = sorted(f.number for f in message.fields)
        assert numbers == list(range(1, len(numbers) + 1)), name


def test_services_have_the_documented_methods() -> None:
    def shape(service: str) -> dict[str, tuple[str, str, bool]]:
        methods = pb.DESCRIPTOR.services_by_name[service].methods
        return {m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
                for m in methods}

    assert shape("DecodeWorker") == {
        "Reserve": ("ReserveRequest", "ReserveResponse", False),
        "Generate": ("GenerateRequest", "TokenChunk", True),
        "GenerateLocal": ("GenerateLocalRequest", "TokenChunk", True),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "Info": ("InfoRequest", "WorkerInfo", False),
        "KVSnapshot": ("KVSnapshotRequest", "KVSnapshotReply", False),
        "SetRole": ("SetRoleRequest", "SetRoleReply", False),
    }
    assert shape("PrefillWorker") == {
        "Prefill": ("PrefillRequest", "PrefillResponse", False),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "Info": ("InfoRequest", "WorkerInfo", False),
        "KVSnapshot": ("KVSnapshotRequest", "KVSnapshotReply", False),
        "SetRole": ("SetRoleRequest", "SetRoleReply", False),
    }


def test_the_public_service_has_the_documented_methods() -> None:
    from pdserve.v1 import generate_pb2

    methods = generate_pb2.DESCRIPTOR.services_by_name["Generation"].methods
    assert {m.name: (m.input_type.name, m.output_type.name, m.server_streaming)
            for m in methods} == {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "GetModelInfo": ("ModelInfoRequest", "ModelInfo", False),
    }
    assert generate_pb2.DESCRIPTOR.package == "pdserve.v1"


# --- round trips ---------------------------------------------------------------------------

def test_seed_zero_is_distinguished_from_absent() -> None:
    seeded = pb.SamplingParams.FromString(make_sampling(seed=0).SerializeToString())
    unseeded = pb.SamplingParams.FromString(make_sampling().SerializeToString())

    assert seeded.HasField("seed") and seeded.seed == 0
    assert not unseeded.HasField("seed")


@pytest.mark.parametrize("message", [
    pb.ReserveRequest(client_request_id="r-1", attempt_id="r-1", prompt_token_ids=[1, 15043, 29892], transfer_id=2**64 - 1,
                      sampling=make_sampling(seed=1234, top_k=50, ignore_eos=True)),
    pb.ReserveResponse(accepted=True, num_blocks=3, target=pb.KVTarget(
        kv_address="127.0.0.1:40123", tensor_parallel_size=2, transfer_id=7)),
    pb.PrefillRequest(client_request_id="r-1", attempt_id="r-1", prompt_token_ids=[1, 2], sampling=make_sampling(),
                      target=pb.KVTarget(kv_address="[::1]:5", tensor_parallel_size=1,
                                         transfer_id=8)),
    pb.PrefillResponse(first_token_id=42, num_cached_tokens=16, num_prompt_tokens=21),
    pb.TokenChunk(token_ids=[42, 43], text="héllo ✓", finish_reason="stop",
                  usage=pb.Usage(prompt_tokens=21, completion_tokens=2, cached_tokens=16)),
    pb.WorkerInfo(worker_id="decode-0", role="decode", tensor_parallel_size=2,
                  model_fingerprint="sha256:ab12",
                  kv=pb.KVCacheUsage(total_blocks=64, free_blocks=50, cached_blocks=6,
                                     pinned_blocks=0, in_use_blocks=8),
                  pending_transfers=1, open_kv_channels=2, running_requests=3,
                  waiting_requests=1),
], ids=lambda m: type(m).__name__)
def test_message_round_trips(message: Message) -> None:
    wire = message.SerializeToString()
    decoded = type(message).FromString(wire)
    assert decoded == message
    assert decoded.SerializeToString() == wire


def test_last_chunk_carries_usage_earlier_chunks_do_not() -> None:
    first = pb.TokenChunk.FromString(pb.TokenChunk(token_ids=[5], text="a").SerializeToString())
    assert first.finish_reason == "" and not first.HasField("usage")


# --- over a real channel -------------------------------------------------------------------

class FakeDecodeWorker(pb_grpc.DecodeWorkerServicer):
    """Streams the prompt back one token per chunk; refuses prompts over 4 tokens."""

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext
                ) -> pb.ReserveResponse:
        if len(request.prompt_token_ids) > 4:
            return pb.ReserveResponse(accepted=False, reason="out of KV blocks")
        return pb.ReserveResponse(accepted=True, num_blocks=1, target=pb.KVTarget(
            kv_address="127.0.0.1:1", tensor_parallel_size=2, transfer_id=request.transfer_id))

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.TokenChunk]:
        if request.attempt_id != "r-1":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation {request.attempt_id!r}")
        yield pb.TokenChunk(token_ids=[7], text="a")
        yield pb.TokenChunk(token_ids=[8], text="b", finish_reason="length",
                            usage=pb.Usage(prompt_tokens=2, completion_tokens=2))


@pytest.fixture
def decode_stub() -> Iterator[pb_grpc.DecodeWorkerStub]:
    pool = futures.ThreadPoolExecutor(max_workers=2)
    server = grpc.server(pool)
    pb_grpc.add_DecodeWorkerServicer_to_server(FakeDecodeWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.DecodeWorkerStub(channel)
    finally:
        channel.close()
        server.stop(grace=None).wait(5)
        pool.shutdown(wait=True)


def test_stub_and_servicer_talk_over_loopback(decode_stub: pb_grpc.DecodeWorkerStub) -> None:
    # 1. Reserve: accepted with the transfer id echoed; refused with a reason.
    ok = decode_stub.Reserve(pb.ReserveRequest(client_request_id="r-1", attempt_id="r-1", prompt_token_ids=[1, 2],
                                               sampling=make_sampling(), transfer_id=9),
                             timeout=5)
    refused = decode_stub.Reserve(pb.ReserveRequest(client_request_id="r-2", attempt_id="r-2", prompt_token_ids=[1] * 5,
                                                    transfer_id=10), timeout=5)
    assert ok.accepted and ok.target.transfer_id == 9
    assert not refused.accepted and refused.reason == "out of KV blocks"
    # 2. Generate streams every chunk; only the last has a finish reason and usage.
    chunks = list(decode_stub.Generate(pb.GenerateRequest(client_request_id="r-1", attempt_id="r-1"), timeout=5))
    assert [list(c.token_ids) for c in chunks] == [[7], [8]]
    assert [c.finish_reason for c in chunks] == ["", "length"]
    assert chunks[-1].usage.completion_tokens == 2 and not chunks[0].HasField("usage")
    # 3. Errors arrive as gRPC status codes.
    with pytest.raises(grpc.RpcError) as err:
        list(decode_stub.Generate(pb.GenerateRequest(client_request_id="nope", attempt_id="nope"), timeout=5))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
