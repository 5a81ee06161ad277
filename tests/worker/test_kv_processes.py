"""KV transfers through real worker processes on loopback: two decode workers (TP 2 and
TP 1) and a prefill worker (TP 1), started through the CLI with the test-only pause
points on (``PDSERVE_TEST_PAUSE_DIR``), driven by this test playing the router.

- the first token and the cached-token count travel with the KV: Generate needs nothing
  from the Prefill response, and copies that disagree fail the request with INTERNAL;
- the prefill worker keeps prefilling while an earlier transfer is stalled (its decode
  worker SIGSTOPped), and unpins a transfer never acknowledged at its deadline;
- layer l's KV reaches the decode ranks while the prefill rank, paused, has not computed
  layer l + 1;
- ``--kv-port 0``: each decode worker advertises the port its store actually bound.

Every scenario ends with the leak check through ``Info`` on the workers it used.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.pause_points import PauseDir
from engine import LLM, SamplingParams
from tests.processes import Proc, stop_all
from tests.worker import calls
from tests.worker.procs import RPC_TIMEOUT_S, assert_idle, proto_params, spawn_worker

pytestmark = pytest.mark.timeout(300)

TRANSFER_TIMEOUT_S = 5.0  # short: one scenario waits for it
WAIT_S = 20.0  # any bounded wait below
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=5, temperature=0.75, seed=11, ignore_eos=True)
_ids = iter(range(10_001, 1 << 30))


@dataclass
class Trio:
    d1: Proc  # decode, TP 2
    d2: Proc  # decode, TP 1
    p: Proc  # prefill, TP 1
    pause: PauseDir
    llm: LLM  # reference generations, same checkpoint

    def decode(self, w: Proc) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(w.channel)

    @property
    def prefill(self) -> pb_grpc.PrefillWorkerStub:
        return pb_grpc.PrefillWorkerStub(self.p.channel)

    def expected(self, prompt: list[int], params: SamplingParams) -> list[int]:
        return self.llm.generate([prompt], params)[0].token_ids


@pytest.fixture(scope="module")
def trio(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    tmp = tmp_path_factory.mktemp("kv-processes")
    pause = PauseDir(tmp / "pause")
    workers: list[Proc] = []
    try:
        for name, role, tp in (("d1", "decode", 2), ("d2", "decode", 1), ("p", "prefill", 1)):
            workers.append(spawn_worker(role, llama_dir, tmp, "--tensor-parallel-size", str(tp),
                                 name=name, env=pause.env(),
                                 transfer_timeout_s=TRANSFER_TIMEOUT_S))
        for w in workers:
            w.wait_ready()
        with LLM(llama_dir) as llm:
            yield Trio(*workers, pause=pause, llm=llm)
    finally:
        stop_all(workers)


def _reserve(stub: pb_grpc.DecodeWorkerStub, prompt: Sequence[int], params: SamplingParams
             ) -> tuple[str, pb.ReserveResponse]:
    n = next(_ids)
    reply = calls.reserve(stub, f"req-{n}", prompt, proto_params(params), n)
    assert reply.accepted, reply.reason
    return f"req-{n}", reply


def _prefill(t: Trio, rid: str, prompt: Sequence[int], params: SamplingParams,
             reserved: pb.ReserveResponse) -> Future[Any]:
    request = calls.prefill_request(rid, prompt, proto_params(params), reserved.target)
    future: Future[Any] = t.prefill.Prefill.future(request, timeout=RPC_TIMEOUT_S)
    return future


def _route(t: Trio, decode: Proc, prompt: list[int], params: SamplingParams) -> list[int]:
    rid, reserved = _reserve(t.decode(decode), prompt, params)
    _prefill(t, rid, prompt, params, reserved).result(WAIT_S)
    return calls.tokens(calls.generate(t.decode(decode), rid))


def _wait_info(stub: Any, cond: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not cond(info := stub.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)):
        assert time.monotonic() < deadline, f"{what}: {info}"
        time.sleep(0.02)
    return info


def _prompt(seed: int, n: int) -> list[int]:
    """Token ids no other scenario uses (so nothing of it is in a prefix cache)."""
    return [(seed * 131 + 7 * i) % 600 + 3 for i in range(n)]


# ------------------------------------------------------------------------ scenarios

def test_decode_workers_advertise_the_kv_port_their_store_bound(trio: Trio) -> None:
    ports = []
    for w in (trio.d1, trio.d2):
        assert w.ready
        host, _, port = w.ready["kv_address"].rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        with socket.create_connection((host, int(port)), timeout=5):
            pass  # rank 0's rendezvous store listens there
        ports.append(int(port))
    assert ports[0] != ports[1]
    # every rank of the TP 2 worker attached to that port: a transfer reaches both
    prompt = _prompt(1, 40)
    assert _route(trio, trio.d1, prompt, GREEDY) == trio.expected(prompt, GREEDY)
    assert_idle(trio.decode(trio.d1), trio.prefill)


def test_first_token_and_cached_count_travel_with_the_kv(trio: Trio) -> None:
    # 1. a new prompt of 4+ blocks, 2. one sharing its first 3 blocks (cached on prefill,
    # and on the decode worker, which then receives only the 4th);
    # Generate is opened before Prefill and carries no copies of the first token
    base = _prompt(2, 70)
    stub = trio.decode(trio.d1)
    with ThreadPoolExecutor(2) as pool:
        for prompt, params, cached in ((base, GREEDY, 0), (base[:50] + [5, 6], SEEDED, 48)):
            rid, reserved = _reserve(stub, prompt, params)
            assert reserved.target.num_cached_blocks == cached // 16
            stream = pool.submit(calls.generate, stub, rid)
            first = _prefill(trio, rid, prompt, params, reserved).result(WAIT_S)
            chunks = stream.result(WAIT_S)
            assert calls.tokens(chunks) == trio.expected(prompt, params)
            assert chunks[0].token_ids[0] == first.first_token_id
            assert chunks[-1].usage.cached_tokens == first.num_cached_tokens == cached
    assert_idle(stub, trio.prefill)


def test_prefill_steps_on_while_a_transfer_is_stalled(trio: Trio) -> None:
    d1, d2 = trio.decode(trio.d1), trio.decode(trio.d2)
    prompt_a, prompt_b = _prompt(5, 70), _prompt(6, 40)
    _route(trio, trio.d1, _prompt(7, 20), GREEDY)  # P knows both decode workers and
    _route(trio, trio.d2, _prompt(8, 20), GREEDY)  # has channels open to them
    rid_a, reserved_a = _reserve(d1, prompt_a, GREEDY)
    rid_b, reserved_b = _reserve(d2, prompt_b, SEEDED)
    trio.d1.proc.send_signal(signal.SIGSTOP)  # decode rank 0 of d1: hung, not dead
    try:
        # 1. A is prefilled; its transfer cannot be acknowledged: its blocks stay pinned
        call_a = _prefill(trio, rid_a, prompt_a, GREEDY, reserved_a)
        _wait_info(trio.prefill, lambda i: i.kv.pinned_blocks >= 5, "A not pinned")
        # 2. meanwhile B is prefilled and its KV reaches d2: Prefill B returns
        first_b = _prefill(trio, rid_b, prompt_b, SEEDED, reserved_b).result(WAIT_S)
        assert not call_a.done()
        info = trio.prefill.Info(pb.InfoRequest(), timeout=RPC_TIMEOUT_S)
        assert info.kv.pinned_blocks >= 5 and info.pending_transfers >= 1, info
    finally:
        trio.d1.proc.send_signal(signal.SIGCONT)
    # 3. d1 resumes: A's transfer is acknowledged, both requests decode correctly
    first_a = call_a.result(WAIT_S)
    chunks_a, chunks_b = calls.generate(d1, rid_a), calls.generate(d2, rid_b)
    assert calls.tokens(chunks_a) == trio.expected(prompt_a, GREEDY)
    assert calls.tokens(chunks_b) == trio.expected(prompt_b, SEEDED)
    assert (chunks_a[0].token_ids[0], chunks_b[0].token_ids[0]) == (
        first_a.first_token_id, first_b.first_token_id)
    assert_idle(d1, d2, trio.prefill)


def test_a_transfer_never_acknowledged_is_unpinned_at_its_deadline(trio: Trio) -> None:
    d1 = trio.decode(trio.d1)
    _route(trio, trio.d1, _prompt(9, 20), GREEDY)  # P knows d1
    prompt = _prompt(10, 40)
    rid, reserved = _reserve(d1, prompt, GREEDY)
    trio.d1.proc.send_signal(signal.SIGSTOP)
    try:
        # 1. pinned while unacknowledged, 2. UNAVAILABLE and unpinned at the deadline
        start = time.monotonic()
        call = _prefill(trio, rid, prompt, GREEDY, reserved)
        _wait_info(trio.prefill, lambda i: i.kv.pinned_blocks >= 3, "not pinned")
        with pytest.raises(grpc.RpcError) as err:
            call.result(WAIT_S)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < TRANSFER_TIMEOUT_S + 5.0
        assert_idle(trio.prefill)
    finally:
        trio.d1.proc.send_signal(signal.SIGCONT)
    # 3. the router's part: abort on decode; d1 serves the next request normally
    d1.Abort(pb.AbortRequest(client_request_id=rid, attempt_id=rid), timeout=RPC_TIMEOUT_S)
    prompt = _prompt(11, 30)
    assert _route(trio, trio.d1, prompt, SEEDED) == trio.expected(prompt, SEEDED)
    assert_idle(d1, trio.prefill)


def test_layer_l_is_sent_before_layer_l_plus_1_is_computed(trio: Trio) -> None:
    d1, point, layer = trio.decode(trio.d1), "kv.layer_sent", 1
    prompt = _prompt(12, 70)  # 3 prefill chunks; only the last one's step sends
    rid, reserved = _reserve(d1, prompt, GREEDY)
    tid = reserved.target.transfer_id
    trio.pause.arm(point, transfer_id=tid, layer=layer)
    try:
        # 1. the prefill rank stops right after computing layer 1 and queuing its send
        call = _prefill(trio, rid, prompt, GREEDY, reserved)
        assert trio.pause.wait_paused(point, WAIT_S)["layer"] == layer
        # 2. meanwhile layers 0 and 1 arrive, verified, on both decode ranks ...
        deadline = time.monotonic() + WAIT_S
        while _received(trio, tid) != {(r, lay) for r in (0, 1) for lay in range(layer + 1)}:
            assert time.monotonic() < deadline, _received(trio, tid)
            time.sleep(0.01)
        # ... while layer 2 has not been computed, and the request has not returned
        assert _computed(trio, tid) == list(range(layer + 1))
        assert not call.done()
    finally:
        trio.pause.disarm(point)
        trio.pause.release(point)
    # 3. released: every layer follows, the request completes normally
    assert call.result(WAIT_S).num_prompt_tokens == len(prompt)
    num_layers = trio.llm.core.config.model.num_layers
    assert _computed(trio, tid) == list(range(num_layers))
    assert _received(trio, tid) == {(r, lay) for r in (0, 1) for lay in range(num_layers)}
    assert calls.tokens(calls.generate(d1, rid)) == trio.expected(prompt, GREEDY)
    assert_idle(d1, trio.prefill)


def _computed(t: Trio, transfer_id: int) -> list[int]:
    """Layers of the transfer the prefill rank computed and queued, in order."""
    return [r["layer"] for r in t.pause.records("kv.layer_sent")
            if r["transfer_id"] == transfer_id]


def _received(t: Trio, transfer_id: int) -> set[tuple[int, int]]:
    """(decode rank, layer) pairs of the transfer complete and verified on d1."""
    return {(r["rank"], r["layer"]) for r in t.pause.records("kv.layer_received")
            if r["transfer_id"] == transfer_id}
