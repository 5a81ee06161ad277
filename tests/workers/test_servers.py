"""The worker processes end to end: a decode worker (TP 2) and a prefill worker (TP 1)
started through the CLI with ready files, driven by this test playing the router over
gRPC on loopback. Every scenario ends with the leak check through ``Info`` on both
workers; the last test stops both with SIGTERM and checks they (and their ranks) exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from pdserve.internal.v1 import worker_pb2 as pb
from pdserve.internal.v1 import worker_pb2_grpc as pb_grpc
from pdserve.redis_server import RedisServer
from pdserve.registry import Registry, RegistryError
from pdserve.worker_common import ReadyInfo
from tests.factories import PROMPTS, REPO_ROOT

pytestmark = pytest.mark.timeout(300)

START_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
NUM_KV_BLOCKS = 64
LONG = " ".join(PROMPTS[3:6])  # several prefill chunks of 32 tokens
_ids = iter(range(1, 1 << 30))


@dataclass
class Worker:
    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready: ReadyInfo | None = None
    channel: grpc.Channel | None = None
    rank_pids: list[int] = field(default_factory=list)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _spawn(role: str, model_dir: Path, tmp: Path, *extra: str) -> Worker:
    log_path = tmp / f"{role}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", role, "--model", str(model_dir),
             "--ready-file", str(tmp / f"{role}.ready.json"),
             "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-batched-tokens", "32",
             "--transfer-timeout", "10", "--grace", "2", *extra],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    return Worker(role, proc, log_path)


def _wait_ready(worker: Worker, tmp: Path) -> None:
    path = tmp / f"{worker.role}.ready.json"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        assert worker.proc.poll() is None, f"{worker.role} exited:\n{worker.log_tail()}"
        assert time.monotonic() < deadline, f"{worker.role} not ready:\n{worker.log_tail()}"
        time.sleep(0.2)
    worker.ready = ReadyInfo.read(path)
    worker.channel = grpc.insecure_channel(worker.ready.grpc_address)
    worker.rank_pids = _children(worker.proc.pid)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@dataclass
class Cluster:
    decode: Worker
    prefill: Worker

    @property
    def d(self) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self.decode.channel)

    @property
    def p(self) -> pb_grpc.PrefillWorkerStub:
        return pb_grpc.PrefillWorkerStub(self.prefill.channel)


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("servers")
    workers: list[Worker] = []
    try:
        workers.append(_spawn("decode", llama_dir, tmp, "--tensor-parallel-size", "2"))
        workers.append(_spawn("prefill", llama_dir, tmp, "--tensor-parallel-size", "1"))
        for w in workers:
            _wait_ready(w, tmp)
        yield Cluster(*workers)
    finally:
        for w in workers:
            _stop(w)
            for pid in w.rank_pids:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def _proto_params(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                            top_k=p.top_k, stop=p.stop, stop_token_ids=p.stop_token_ids,
                            ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def _route(c: Cluster, prompt: Sequence[int], params: SamplingParams
           ) -> tuple[list[int], Any, Any]:
    """The router's handoff: Reserve → Prefill → Generate. Returns (tokens, last chunk,
    PrefillResponse)."""
    n = next(_ids)
    rid, sampling = f"req-{n}", _proto_params(params)
    reserved = c.d.Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                             sampling=sampling, transfer_id=n),
                           timeout=RPC_TIMEOUT_S)
    assert reserved.accepted, reserved.reason
    try:
        first = c.p.Prefill(pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt,
                                              sampling=sampling, target=reserved.target),
                            timeout=RPC_TIMEOUT_S)
        chunks = list(c.d.Generate(pb.GenerateRequest(
            request_id=rid, first_token_id=first.first_token_id,
            num_cached_tokens=first.num_cached_tokens), timeout=RPC_TIMEOUT_S))
    except BaseException:
        c.d.Abort(pb.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
        c.p.Abort(pb.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
        raise
    assert chunks and chunks[0].token_ids[0] == first.first_token_id
    assert all(not ch.finish_reason for ch in chunks[:-1]) and chunks[-1].finish_reason
    assert chunks[-1].usage.cached_tokens == first.num_cached_tokens  # the prefill's count
    return [t for ch in chunks for t in ch.token_ids], chunks[-1], first


def _assert_no_leaks(c: Cluster) -> None:
    """Both workers: no block in use or pinned, nothing pending, running or waiting."""
    for stub in (c.d, c.p):
        info = stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        kv = info.kv
        assert kv.free_blocks + kv.cached_blocks + kv.pinned_blocks + kv.in_use_blocks == \
            kv.total_blocks == NUM_KV_BLOCKS, info
        assert (kv.in_use_blocks, kv.pinned_blocks, info.pending_transfers,
                info.running_requests, info.waiting_requests) == (0, 0, 0, 0, 0), info


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
    assert cluster.decode.ready is not None and cluster.prefill.ready is not None
    assert cluster.decode.ready.role == "decode" and cluster.decode.ready.kv_address
    assert len(cluster.decode.rank_pids) >= 1  # the follower rank of TP 2
    for w in (cluster.decode, cluster.prefill):
        health = health_pb2_grpc.HealthStub(w.channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
    assert (info.role, info.tensor_parallel_size) == ("decode", 2)
    _assert_no_leaks(cluster)


def test_concurrent_handoffs_match_llm(cluster: Cluster, llama_dir: Path) -> None:
    with LLM(llama_dir) as llm:
        prompts, params = _workload(llm)
        expected = [r.token_ids for r in llm.generate(prompts, params)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda a: _route(cluster, *a), zip(prompts, params, strict=True)))
    assert [tokens for tokens, _, _ in results] == expected
    for (tokens, last, first), prompt in zip(results, prompts, strict=True):
        assert last.usage.completion_tokens == len(tokens)
        assert last.usage.prompt_tokens == first.num_prompt_tokens == len(prompt)
    _assert_no_leaks(cluster)


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
    _assert_no_leaks(cluster)


def test_abort_between_reserve_and_prefill_frees_everything(cluster: Cluster) -> None:
    # 1. reserve on decode, 2. abort instead of prefilling, 3. Generate finds nothing
    prompt, n = list(range(1, 60)), next(_ids)
    reserved = cluster.d.Reserve(pb.ReserveRequest(
        request_id=f"req-{n}", prompt_token_ids=prompt, transfer_id=n,
        sampling=_proto_params(SamplingParams(max_tokens=4, temperature=0))),
        timeout=RPC_TIMEOUT_S)
    assert reserved.accepted and reserved.num_blocks == 4
    info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.kv.in_use_blocks >= 4 and info.waiting_requests == 1
    abort = pb.AbortRequest(request_id=f"req-{n}")
    assert cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found
    assert not cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found  # idempotent
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.d.Generate(pb.GenerateRequest(request_id=f"req-{n}", first_token_id=1),
                                timeout=RPC_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    _assert_no_leaks(cluster)


def _reserve_then_prefill(c: Cluster, prompts: Sequence[Sequence[int]], params: SamplingParams
                          ) -> list[tuple[str, Any]]:
    """Reserve each prompt on decode, then start all their Prefill calls back to back
    without waiting: [(request id, call future)]."""
    sampling, requests = _proto_params(params), []
    for prompt in prompts:
        n = next(_ids)
        reserved = c.d.Reserve(pb.ReserveRequest(request_id=f"req-{n}", prompt_token_ids=prompt,
                                                 sampling=sampling, transfer_id=n),
                               timeout=RPC_TIMEOUT_S)
        assert reserved.accepted, reserved.reason
        requests.append(pb.PrefillRequest(request_id=f"req-{n}", prompt_token_ids=prompt,
                                          sampling=sampling, target=reserved.target))
    return [(r.request_id, c.p.Prefill.future(r, timeout=RPC_TIMEOUT_S)) for r in requests]


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
                found_a = cluster.p.Abort(pb.AbortRequest(request_id=rid_a),
                                          timeout=RPC_TIMEOUT_S).found
        finally:
            for rid, call in calls:
                if not (hit and found_a):  # a missed window (or a failure): end it all
                    cluster.p.Abort(pb.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
                cluster.d.Abort(pb.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
                try:
                    call.result(timeout=RPC_TIMEOUT_S)
                except (grpc.RpcError, grpc.FutureCancelledError):
                    pass
        if hit and found_a:
            assert call_a.exception().code() == grpc.StatusCode.ABORTED
            assert call_b.cancelled()
            _wait_prefill_idle(cluster)
            assert not cluster.p.Abort(pb.AbortRequest(request_id=rid_b),
                                       timeout=RPC_TIMEOUT_S).found  # the call's end freed it
            _assert_no_leaks(cluster)
            return
        _wait_prefill_idle(cluster)
        _assert_no_leaks(cluster)
    pytest.fail("the prefill worker never showed one request prefilling and one queued")


def test_reserve_refused_when_out_of_blocks(cluster: Cluster) -> None:
    sampling = _proto_params(SamplingParams(max_tokens=4, temperature=0))
    prompt = [1 + i % 400 for i in range(16 * 15)]  # 15 blocks each
    held = []
    try:
        for _ in range(NUM_KV_BLOCKS // 15 + 1):
            n = next(_ids)
            reply = cluster.d.Reserve(pb.ReserveRequest(
                request_id=f"req-{n}", prompt_token_ids=prompt, transfer_id=n,
                sampling=sampling), timeout=RPC_TIMEOUT_S)
            if not reply.accepted:
                break
            held.append(f"req-{n}")
        assert not reply.accepted and "out of KV blocks" in reply.reason, reply
        assert not reply.HasField("target") and reply.num_blocks == 0
        assert len(held) == NUM_KV_BLOCKS // 15
    finally:
        for rid in held:
            cluster.d.Abort(pb.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
    _assert_no_leaks(cluster)


def test_cancelled_generate_frees_everything(cluster: Cluster) -> None:
    # 1. reserve, prefill, 2. read one chunk of a long stream, 3. cancel the call
    prompt, n = list(range(1, 40)), next(_ids)
    sampling = _proto_params(SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    reserved = cluster.d.Reserve(pb.ReserveRequest(
        request_id=f"req-{n}", prompt_token_ids=prompt, transfer_id=n, sampling=sampling),
        timeout=RPC_TIMEOUT_S)
    assert reserved.accepted, reserved.reason
    first = cluster.p.Prefill(pb.PrefillRequest(
        request_id=f"req-{n}", prompt_token_ids=prompt, sampling=sampling,
        target=reserved.target), timeout=RPC_TIMEOUT_S)
    call = cluster.d.Generate(pb.GenerateRequest(
        request_id=f"req-{n}", first_token_id=first.first_token_id), timeout=RPC_TIMEOUT_S)
    assert next(call).token_ids[0] == first.first_token_id
    call.cancel()
    deadline = time.monotonic() + 10.0
    while True:  # the abort runs when the server sees the cancellation
        info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        if info.running_requests == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert not cluster.d.Abort(pb.AbortRequest(request_id=f"req-{n}"), timeout=RPC_TIMEOUT_S).found
    _assert_no_leaks(cluster)


def test_abort_between_prefill_and_generate_frees_everything(cluster: Cluster) -> None:
    # 1. reserve, prefill (its KV is on the decode worker once Prefill returns),
    # 2. abort on decode instead of opening Generate, 3. Generate finds nothing
    prompt, n = list(range(1, 60)), next(_ids)
    rid = f"req-{n}"
    sampling = _proto_params(SamplingParams(max_tokens=4, temperature=0))
    reserved = cluster.d.Reserve(pb.ReserveRequest(
        request_id=rid, prompt_token_ids=prompt, transfer_id=n, sampling=sampling),
        timeout=RPC_TIMEOUT_S)
    assert reserved.accepted and reserved.num_blocks == 4, reserved
    try:
        first = cluster.p.Prefill(pb.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling,
            target=reserved.target), timeout=RPC_TIMEOUT_S)
        assert first.num_prompt_tokens == len(prompt)
        info = cluster.d.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        assert info.kv.in_use_blocks >= 4 and info.running_requests == 0, info
        abort = pb.AbortRequest(request_id=rid)
        assert cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found
        assert not cluster.d.Abort(abort, timeout=RPC_TIMEOUT_S).found  # idempotent
    finally:
        cluster.d.Abort(pb.AbortRequest(request_id=rid), timeout=RPC_TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.d.Generate(pb.GenerateRequest(
            request_id=rid, first_token_id=first.first_token_id,
            num_cached_tokens=first.num_cached_tokens), timeout=RPC_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    _assert_no_leaks(cluster)


def test_sigterm_stops_both_workers(cluster: Cluster) -> None:
    # runs last: the module's workers are gone afterwards
    for w in (cluster.decode, cluster.prefill):
        w.proc.send_signal(signal.SIGTERM)
    for w in (cluster.decode, cluster.prefill):
        assert w.proc.wait(STOP_TIMEOUT_S) == 0, w.log_tail()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    ranks = cluster.decode.rank_pids + cluster.prefill.rank_pids
    while any(_alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, [pid for pid in ranks if _alive(pid)]
        threading.Event().wait(0.1)


# ------------------------------------------------------------------------ registration

def test_registers_once_ready_and_refuses_a_differing_fingerprint(
        llama_dir: Path, tmp_path: Path) -> None:
    workers: list[Worker] = []
    with RedisServer(start_timeout_s=10.0) as redis_server, Registry(redis_server.url) as registry:
        try:
            # 1. a worker registers once ready (its ready file is written after the record)
            good = _spawn("prefill", llama_dir, tmp_path, "--redis-url", redis_server.url,
                          "--worker-id", "prefill-a")
            workers.append(good)
            _wait_ready(good, tmp_path)
            (record,) = registry.list_workers()
            assert good.ready is not None and record.grpc_address == good.ready.grpc_address
            assert (record.worker_id, record.role, record.total_kv_blocks) == \
                ("prefill-a", "prefill", NUM_KV_BLOCKS)
            # 2. another KV layout (block size): it exits naming the field, unregistered
            other_dir = tmp_path / "other"
            other_dir.mkdir()
            bad = _spawn("prefill", llama_dir, other_dir, "--redis-url", redis_server.url,
                         "--worker-id", "prefill-b", "--block-size", "32")
            workers.append(bad)
            assert bad.proc.wait(START_TIMEOUT_S) != 0
            assert "block_size" in bad.log_tail()
            assert not (other_dir / "prefill.ready.json").exists()
            assert [r.worker_id for r in registry.list_workers()] == ["prefill-a"]
            # 3. SIGTERM: exits 0 and deregisters
            good.proc.send_signal(signal.SIGTERM)
            assert good.proc.wait(STOP_TIMEOUT_S) == 0, good.log_tail()
            assert registry.list_workers() == []
        finally:
            for w in workers:
                _stop(w)


HEARTBEAT_S, TTL_S = 0.2, 1.0  # the short-TTL workers below


def _wait_until(cond: Any, timeout_s: float, what: str) -> float:
    """Poll ``cond()`` (Redis errors count as False) until true; the seconds it took."""
    start = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - start
        except RegistryError:
            pass
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s}s: {what}"
        time.sleep(0.02)


def _spawn_registered(llama_dir: Path, tmp: Path, redis_url: str, worker_id: str) -> Worker:
    worker = _spawn("prefill", llama_dir, tmp, "--redis-url", redis_url, "--worker-id",
                    worker_id, "--heartbeat-interval", str(HEARTBEAT_S),
                    "--registration-ttl", str(TTL_S))
    try:
        _wait_ready(worker, tmp)
    except BaseException:
        _stop(worker)
        raise
    return worker


def _stop(worker: Worker) -> None:
    if worker.proc.poll() is None:
        worker.proc.send_signal(signal.SIGCONT)  # harmless unless it was stopped
        worker.proc.terminate()
        try:
            worker.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait(STOP_TIMEOUT_S)
    if worker.channel is not None:
        worker.channel.close()


def _ids_of(registry: Registry) -> list[str]:
    return [r.worker_id for r in registry.list_workers()]


def test_frozen_worker_expires_and_comes_back(llama_dir: Path, tmp_path: Path) -> None:
    # 1. SIGSTOP: no more heartbeats, the record is gone after its TTL;
    # 2. SIGCONT: the next beat (due at once) writes it again
    with RedisServer(start_timeout_s=10.0) as redis_server, Registry(redis_server.url) as registry:
        worker = _spawn_registered(llama_dir, tmp_path, redis_server.url, "prefill-frozen")
        try:
            assert _ids_of(registry) == ["prefill-frozen"]
            worker.proc.send_signal(signal.SIGSTOP)
            gone = _wait_until(lambda: _ids_of(registry) == [], TTL_S + 10.0, "expiry")
            assert gone <= TTL_S + 1.0, gone
            worker.proc.send_signal(signal.SIGCONT)
            back = _wait_until(lambda: _ids_of(registry) == ["prefill-frozen"],
                               10.0, "re-registration")
            assert back <= HEARTBEAT_S + 1.0, back
            stub = pb_grpc.PrefillWorkerStub(worker.channel)
            assert stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S).worker_id == \
                "prefill-frozen"
        finally:
            _stop(worker)


def test_worker_reregisters_after_redis_restart(llama_dir: Path, tmp_path: Path) -> None:
    # Redis comes back empty: the heartbeat writes the record and the fingerprint again
    with RedisServer(start_timeout_s=10.0) as redis_server, Registry(redis_server.url) as registry:
        worker = _spawn_registered(llama_dir, tmp_path, redis_server.url, "prefill-r")
        try:
            assert _ids_of(registry) == ["prefill-r"]
            layout = registry.cluster_layout()
            assert layout is not None
            with redis.Redis.from_url(redis_server.url) as client:
                client.set("sentinel", "1")
            redis_server.restart()
            with redis.Redis.from_url(redis_server.url) as client:
                assert client.get("sentinel") is None  # the data is gone
            back = _wait_until(lambda: _ids_of(registry) == ["prefill-r"]
                               and registry.cluster_layout() == layout, 10.0, "re-registration")
            assert back <= HEARTBEAT_S + 2.0, back  # one beat (+ a reconnect)
            (record,) = registry.list_workers()
            assert worker.ready is not None and record.grpc_address == worker.ready.grpc_address
            stub = pb_grpc.PrefillWorkerStub(worker.channel)
            info = stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
            assert (info.worker_id, info.kv.total_blocks) == ("prefill-r", NUM_KV_BLOCKS)
            assert worker.proc.poll() is None, worker.log_tail()
        finally:
            _stop(worker)


def test_worker_common_is_torch_free() -> None:
    code = "import sys, pdserve.worker_common, pdserve.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)
