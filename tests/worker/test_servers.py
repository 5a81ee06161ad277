"""The worker processes end to end: a decode worker (TP 2) and a prefill worker (TP 1)
started through the CLI with ready files, driven by this test playing the router over
gRPC on loopback. Every scenario ends with the leak check through ``Info`` on both
workers; the last test stops both with SIGTERM and checks they (and their ranks) exit."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from engine import LLM, SamplingParams
from tests.factories import PROMPTS
from tests.processes import STOP_TIMEOUT_S, Proc, alive, stop_all
from tests.worker.procs import NUM_KV_BLOCKS, RPC_TIMEOUT_S, assert_idle, proto_params, spawn_worker

pytestmark = pytest.mark.timeout(300)

LONG = " ".join(PROMPTS[3:6])  # several prefill chunks of 32 tokens
_ids = iter(range(1, 1 << 30))


@dataclass
class Cluster:
    decode: Proc
    prefill: Proc

    @property
    def d(self) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self.decode.channel)

    @property
    def p(self) -> pb_grpc.PrefillWorkerStub:
        return pb_grpc.PrefillWorkerStub(self.prefill.channel)


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("servers")
    workers: list[Proc] = []
    try:
        workers.append(spawn_worker("decode", llama_dir, tmp, "--tensor-parallel-size", "2"))
        workers.append(spawn_worker("prefill", llama_dir, tmp, "--tensor-parallel-size", "1"))
        for w in workers:
            w.wait_ready()
        yield Cluster(*workers)
    finally:
        stop_all(workers)


def _route(c: Cluster, prompt: Sequence[int], params: SamplingParams
           ) -> tuple[list[int], Any, Any]:
    """The router's part, by hand: Reserve → Prefill → Generate. Returns (tokens, last chunk,
    PrefillResponse)."""
    n = next(_ids)
    rid, sampling = f"req-{n}", proto_params(params)
    reserved = c.d.Reserve(pb.ReserveRequest(client_request_id=rid, attempt_id=rid, prompt_token_ids=prompt,
                                             sampling=sampling, transfer_id=n),
                           timeout=RPC_TIMEOUT_S)
    assert reserved.accepted, reserved.reason
    try:
        first = c.p.Prefill(pb.PrefillRequest(client_request_id=rid, attempt_id=rid, prompt_token_ids=prompt,
                                              sampling=sampling, target=reserved.target),
                            timeout=RPC_TIMEOUT_S)
        chunks = list(c.d.Generate(pb.GenerateRequest(
            client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S))
    except BaseException:
        c.d.Abort(pb.AbortRequest(client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S)
        c.p.Abort(pb.AbortRequest(client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S)
        raise
    assert chunks and chunks[0].token_ids[0] == first.first_token_id
    assert all(not ch.finish_reason for ch in chunks[:-1]) and chunks[-1].finish_reason
    assert chunks[-1].usage.cached_tokens == first.num_cached_tokens  # the prefill's count
    return [t for ch in chunks for t in ch.token_ids], chunks[-1], first


# ------------------------------------------------------------------------ scenarios

def _workload(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    # 16 prompts from 1 to ~100 tokens (several prefill chunks), some sharing prefixes
    texts = [PROMPTS[0], PROMPTS[2], PROMPTS[3], LONG, PROMPTS[1], PROMPTS[6], LONG + "!",
             PROMPTS[9], PROMPTS[4], PROMPTS[5], PROMPTS[7], PROMPTS[8], PROMPTS[0] + " again",
             PROMPTS[3] + " twice", "x", PROMPTS[9] + PROMPTS[1]]
    prompts = [llm.encode(t) for t in texts]
    # temperatures exact in float32, so the protobuf float carries them unchanged
    params = [SamplingParams(max_tokens=6 + i % 3, temperature=0, ignore_eos=True) if i % 2
              else SamplingParams(max_tokens=7, temperature=0.75, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    return prompts, params


def test_workers_ready_and_serving(cluster: Cluster) -> None:
    assert cluster.decode.ready and cluster.prefill.ready
    assert cluster.decode.ready["role"] == "decode" and cluster.decode.ready["kv_address"]
    assert len(cluster.decode.child_pids) >= 1  # the follower rank of TP 2
    for w in (cluster.decode, cluster.prefill):
        health = health_pb2_grpc.HealthStub(w.channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
    assert (info.role, info.tensor_parallel_size) == ("decode", 2)
    assert_idle(cluster.d, cluster.p)


def test_concurrent_requests_through_both_workers_match_llm(cluster: Cluster, llama_dir: Path) -> None:
    with LLM(llama_dir) as llm:
        prompts, params = _workload(llm)
        expected = [r.token_ids for r in llm.generate(prompts, params)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda a: _route(cluster, *a), zip(prompts, params, strict=True)))
    assert [tokens for tokens, _, _ in results] == expected
    for (tokens, last, first), prompt in zip(results, prompts, strict=True):
        assert last.usage.completion_tokens == len(tokens)
        assert last.usage.prompt_tokens == first.num_prompt_tokens == len(prompt)
        if len(prompt) >= 32:  # its own steps filled the token budget: measured by then
            assert first.prefill_tokens_per_s > 0  # (worker.prefill_rate)
    assert_idle(cluster.d, cluster.p)


def test_shared_prefix_reports_cached_tokens(cluster: Cluster, llama_dir: Path) -> None:
    # 1. a prompt of 4+ blocks, new to the prefill worker's cache; 2. two prompts sharing
    # its first blocks: the prefill worker serves those from its prefix cache
    with LLM(llama_dir) as llm:
        base = llm.encode("shared prefix " + PROMPTS[7] * 3)
        prompts = [base, base[:50] + llm.encode(" then " + PROMPTS[6]), base + [5, 6, 7]]
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=6, temperature=0.75, seed=7, ignore_eos=True),
                  SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
        expected = [r.token_ids for r in llm.generate(prompts, params)]
    assert len(base) >= 64
    results = [_route(cluster, prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    assert [tokens for tokens, _, _ in results] == expected
    cached = [first.num_cached_tokens for _, _, first in results]
    assert cached[0] == 0, cached
    assert (cached[1], cached[2]) == (48, len(base) // 16 * 16), cached  # whole blocks of 16
    assert [last.usage.cached_tokens for _, last, _ in results] == cached
    assert_idle(cluster.d, cluster.p)


def test_abort_between_reserve_and_prefill_frees_everything(cluster: Cluster) -> None:
    # 1. reserve on decode, 2. abort instead of prefilling, 3. Generate finds nothing
    prompt, n = list(range(1, 60)), next(_ids)
    reserved = cluster.d.Reserve(pb.ReserveRequest(
        client_request_id=f"req-{n}", attempt_id=f"req-{n}", prompt_token_ids=prompt, transfer_id=n,
        sampling=proto_params(SamplingParams(max_tokens=4, temperature=0))),
        timeout=RPC_TIMEOUT_S)
    assert reserved.accepted and reserved.num_blocks == 4
    info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.kv.in_use_blocks >= 4 and info.waiting_requests == 1
    abort = pb.AbortRequest(client_request_id=f"req-{n}", attempt_id=f"req-{n}")
    assert cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found
    assert not cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found  # idempotent
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.d.Generate(pb.GenerateRequest(client_request_id=f"req-{n}", attempt_id=f"req-{n}"),
                                timeout=RPC_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_idle(cluster.d, cluster.p)


def _reserve_then_prefill(c: Cluster, prompts: Sequence[Sequence[int]], params: SamplingParams
                          ) -> list[tuple[str, Any]]:
    """Reserve each prompt on decode, then start all their Prefill calls back to back
    without waiting: [(request id, call future)]."""
    sampling, requests = proto_params(params), []
    for prompt in prompts:
        n = next(_ids)
        reserved = c.d.Reserve(pb.ReserveRequest(client_request_id=f"req-{n}", attempt_id=f"req-{n}", prompt_token_ids=prompt,
                                                 sampling=sampling, transfer_id=n),
                               timeout=RPC_TIMEOUT_S)
        assert reserved.accepted, reserved.reason
        requests.append(pb.PrefillRequest(client_request_id=f"req-{n}", attempt_id=f"req-{n}", prompt_token_ids=prompt,
                                          sampling=sampling, target=reserved.target))
    return [(r.attempt_id, c.p.Prefill.future(r, timeout=RPC_TIMEOUT_S)) for r in requests]


def _wait_prefill_idle(c: Cluster) -> None:
    deadline = time.monotonic() + 10.0
    while True:  # a cancellation reaches the server's callback asynchronously
        info = c.p.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        if info.running_requests == info.waiting_requests == info.kv.pinned_blocks == 0:
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.02)


def test_abort_while_queued_or_prefilling_frees_everything(cluster: Cluster) -> None:
    # 1. two prompts of 12 prefill chunks each at once: one prefilling, one queued behind
    # it; 2. once Info shows both, Abort the first and cancel the second's Prefill call;
    # 3. the router's part: abort both reservations on decode. A round where either
    # finished first (the window missed) is repeated with new prompts.
    params = SamplingParams(max_tokens=4, temperature=0)
    for attempt in range(5):
        prompts = [[1 + (attempt * 131 + k * 17 + i * 7) % 600 for i in range(384)]
                   for k in range(2)]
        calls = _reserve_then_prefill(cluster, prompts, params)
        (rid_a, call_a), (rid_b, call_b) = calls
        hit = found_a = False
        try:
            deadline = time.monotonic() + 10.0
            while not (call_a.done() or call_b.done()) and time.monotonic() < deadline:
                info = cluster.p.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
                if info.running_requests >= 1 and info.waiting_requests >= 1:
                    hit = True
                    break
            if hit:
                call_b.cancel()
                found_a = cluster.p.Abort(pb.AbortRequest(client_request_id=rid_a, attempt_id=rid_a),
                                          timeout=RPC_TIMEOUT_S).found
        finally:
            for rid, call in calls:
                if not (hit and found_a):  # a missed window (or a failure): end it all
                    cluster.p.Abort(pb.AbortRequest(client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S)
                cluster.d.Abort(pb.AbortRequest(client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S)
                try:
                    call.result(timeout=RPC_TIMEOUT_S)
                except (grpc.RpcError, grpc.FutureCancelledError):
                    pass
        if hit and found_a:
            assert call_a.exception().code() == grpc.StatusCode.ABORTED
            assert call_b.cancelled()
            _wait_prefill_idle(cluster)
            assert not cluster.p.Abort(pb.AbortRequest(client_request_id=rid_b, attempt_id=rid_b),
                                       timeout=RPC_TIMEOUT_S).found  # the call's end freed it
            assert_idle(cluster.d, cluster.p)
            return
        _wait_prefill_idle(cluster)
        assert_idle(cluster.d, cluster.p)
    pytest.fail("the prefill worker never showed one request prefilling and one queued")


def test_reserve_refused_when_out_of_blocks(cluster: Cluster) -> None:
    sampling = proto_params(SamplingParams(max_tokens=4, temperature=0))
    prompt = [1 + i % 400 for i in range(16 * 15)]  # 15 blocks each
    held = []
    try:
        for _ in range(NUM_KV_BLOCKS // 15 + 1):
            n = next(_ids)
            reply = cluster.d.Reserve(pb.ReserveRequest(
                client_request_id=f"req-{n}", attempt_id=f"req-{n}", prompt_token_ids=prompt, transfer_id=n,
                sampling=sampling), timeout=RPC_TIMEOUT_S)
            if not reply.accepted:
                break
            held.append(f"req-{n}")
        assert not reply.accepted and "out of KV blocks" in reply.reason, reply
        assert not reply.HasField("target") and reply.num_blocks == 0
        assert len(held) == NUM_KV_BLOCKS // 15
    finally:
        for rid in held:
            cluster.d.Abort(pb.AbortRequest(client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S)
    assert_idle(cluster.d, cluster.p)


def test_cancelled_generate_frees_everything(cluster: Cluster) -> None:
    # 1. reserve, prefill, 2. read one chunk of a long stream, 3. cancel the call
    prompt, n = list(range(1, 40)), next(_ids)
    sampling = proto_params(SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    reserved = cluster.d.Reserve(pb.ReserveRequest(
        client_request_id=f"req-{n}", attempt_id=f"req-{n}", prompt_token_ids=prompt, transfer_id=n, sampling=sampling),
        timeout=RPC_TIMEOUT_S)
    assert reserved.accepted, reserved.reason
    first = cluster.p.Prefill(pb.PrefillRequest(
        client_request_id=f"req-{n}", attempt_id=f"req-{n}", prompt_token_ids=prompt, sampling=sampling,
        target=reserved.target), timeout=RPC_TIMEOUT_S)
    call = cluster.d.Generate(pb.GenerateRequest(
        client_request_id=f"req-{n}", attempt_id=f"req-{n}"), timeout=RPC_TIMEOUT_S)
    assert next(call).token_ids[0] == first.first_token_id
    call.cancel()
    deadline = time.monotonic() + 10.0
    while True:  # the abort runs when the server sees the cancellation
        info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        if info.running_requests == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert not cluster.d.Abort(pb.AbortRequest(client_request_id=f"req-{n}", attempt_id=f"req-{n}"), timeout=RPC_TIMEOUT_S).found
    assert_idle(cluster.d, cluster.p)


def test_abort_between_prefill_and_generate_frees_everything(cluster: Cluster) -> None:
    # 1. reserve, prefill (its KV is on the decode worker once Prefill returns),
    # 2. abort on decode instead of opening Generate, 3. Generate finds nothing
    prompt, n = list(range(1, 60)), next(_ids)
    rid = f"req-{n}"
    sampling = proto_params(SamplingParams(max_tokens=4, temperature=0))
    reserved = cluster.d.Reserve(pb.ReserveRequest(
        client_request_id=rid, attempt_id=rid, prompt_token_ids=prompt, transfer_id=n, sampling=sampling),
        timeout=RPC_TIMEOUT_S)
    assert reserved.accepted and reserved.num_blocks == 4, reserved
    try:
        first = cluster.p.Prefill(pb.PrefillRequest(
            client_request_id=rid, attempt_id=rid, prompt_token_ids=prompt, sampling=sampling,
            target=reserved.target), timeout=RPC_TIMEOUT_S)
        assert first.num_prompt_tokens == len(prompt)
        info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        assert info.kv.in_use_blocks >= 4 and info.running_requests == 0, info
        abort = pb.AbortRequest(client_request_id=rid, attempt_id=rid)
        assert cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found
        assert not cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found  # idempotent
    finally:
        cluster.d.Abort(pb.AbortRequest(client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.d.Generate(pb.GenerateRequest(
            client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_idle(cluster.d, cluster.p)


def test_sigterm_stops_both_workers(cluster: Cluster) -> None:
    # runs last: the module's workers are gone afterwards
    for w in (cluster.decode, cluster.prefill):
        w.proc.send_signal(signal.SIGTERM)
    for w in (cluster.decode, cluster.prefill):
        assert w.proc.wait(STOP_TIMEOUT_S) == 0, w.log_tail()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    ranks = cluster.decode.child_pids + cluster.prefill.child_pids
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, [pid for pid in ranks if alive(pid)]
        threading.Event().wait(0.1)
