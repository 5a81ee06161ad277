"""RELIABILITY row 16: a client cancels in every window of a request's life, through the
router (real processes: Redis, a prefill and a decode worker, the router). A pause point
holds the request exactly in its window, the client cancels, the test releases it, and
the workers' own records show the work stopped within one scheduler step: no KV layer
sent, no token decoded beyond the step that was running. Every test ends with the whole
cluster's leak check (workers, the router's holdings, Redis: no lease left).

Windows: queued at the router; prefilling; during the KV transfer; between prefill and
decode (the KV arrived, no stream yet); decoding; after the finish.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import grpc
import pytest

from cluster.pause_points import PauseDir
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from tests.e2e.cluster import Cluster
from tests.leaks import router_holdings
from tests.processes import wait_until

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
PAUSED_S = 30.0
_salts = itertools.count(1)


CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1}


_channels: list[grpc.Channel] = []  # closed after each test (never from a call's callback:
# a channel closed on its own callback thread deadlocks)


@pytest.fixture
def idle(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster; the test's channels are closed after it (before the leak check)."""
    try:
        yield cluster
    finally:
        while _channels:
            _channels.pop().close()


def _prompt(num_tokens: int) -> list[int]:
    """A prompt no other test shares a block with (nothing of it is cached)."""
    salt = next(_salts)
    return [3 + (salt * 101 + 13 * i) % 650 for i in range(num_tokens)]


def _start(c: Cluster, rid: str, prompt: list[int], max_tokens: int) -> grpc.Future:
    channel = grpc.insecure_channel(c.address)
    call = gpb_grpc.GenerationStub(channel).Generate(gpb.GenerateRequest(
        request_id=rid, token_ids=gpb.TokenIds(ids=prompt), sampling=gpb.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=TIMEOUT_S)
    _channels.append(channel)
    return call


def _cancelled(call: grpc.Future) -> None:
    call.cancel()
    with pytest.raises(grpc.RpcError) as excinfo:
        for _ in call:
            pass
    assert excinfo.value.code() == grpc.StatusCode.CANCELLED


def _router_let_go(c: Cluster) -> None:
    """The router ended every attempt (its aborts are sent, its leases closed)."""
    assert c.router is not None
    address = c.router.ready["debug_address"]
    wait_until(lambda: not router_holdings(address).attempt_ids, 20.0,
               "the router to end the attempt")


def _decode_holds_nothing(c: Cluster) -> bool:
    return not c.info(c.decode[0]).attempt_ids


def _sent(pause: PauseDir, transfer_id: object) -> list[dict[str, int | str]]:
    return [r for r in pause.records("kv.layer_sent") if r["transfer_id"] == transfer_id]


def test_cancel_while_queued_at_the_router(idle: Cluster) -> None:
    c = idle
    router, decode = PauseDir(c.pause_dir("router")), PauseDir(c.pause_dir("decode-0"))
    started = c.info(c.prefill[0]).num_started_requests
    router.arm("router.queued", request_id="w-queued")
    call = _start(c, "w-queued", _prompt(40), 8)
    router.wait_paused("router.queued", PAUSED_S)
    _cancelled(call)
    # the client's cancel is local at once; the router learns it over the connection: wait
    # until it has (the request left its admission, the paused task was cancelled) before
    # releasing, or the released request could race ahead to a Reserve
    assert c.router is not None
    debug = c.router.ready["debug_address"]
    wait_until(lambda: "w-queued" not in router_holdings(debug).request_ids, 20.0,
               "the router to see the cancel")
    router.release("router.queued")
    _router_let_go(c)
    # nothing ever reached a worker
    assert not [r for r in decode.records("decode.reserved") if r["request_id"] == "w-queued"]
    assert c.info(c.prefill[0]).num_started_requests == started


def _computed(pause: PauseDir, attempt: object) -> list[int]:
    return [int(r["num_computed_tokens"]) for r in pause.records("prefill.computed")
            if r["attempt_id"] == attempt]


def test_cancel_while_prefilling(idle: Cluster) -> None:
    c = idle
    prefill = PauseDir(c.pause_dir(0))
    prefill.arm("prefill.started")
    call = _start(c, "w-prefilling", _prompt(320), 8)  # 10 chunks of 32 tokens
    paused = prefill.wait_paused("prefill.started", PAUSED_S)
    attempt, transfer_id = paused["attempt_id"], paused["transfer_id"]
    try:
        assert _computed(prefill, attempt) == [32]  # its first chunk
        _cancelled(call)
        _router_let_go(c)
        wait_until(lambda: _decode_holds_nothing(c), 20.0, "decode to free its reservation")
    finally:
        prefill.release("prefill.started")
    wait_until(lambda: not c.info(c.prefill[0]).attempt_ids, 20.0, "prefill to stop")
    # the step about to run when it was cancelled, no other: 2 of its 10 chunks, no KV sent
    assert max(_computed(prefill, attempt)) <= 64
    assert not _sent(prefill, transfer_id)


def test_cancel_during_the_transfer(idle: Cluster) -> None:
    c = idle
    prefill, decode = PauseDir(c.pause_dir(0)), PauseDir(c.pause_dir("decode-0"))
    prefill.arm("kv.layer_sent", layer=0)
    call = _start(c, "w-transfer", _prompt(320), 8)
    paused = prefill.wait_paused("kv.layer_sent", PAUSED_S)
    transfer_id = paused["transfer_id"]
    try:
        _cancelled(call)
        _router_let_go(c)
        wait_until(lambda: _decode_holds_nothing(c), 20.0, "decode to free its reservation")
        sent = len(_sent(prefill, transfer_id))
    finally:
        prefill.release("kv.layer_sent")
    wait_until(lambda: not c.info(c.prefill[0]).attempt_ids, 20.0, "prefill to stop")
    layers = {r["layer"] for r in _sent(prefill, transfer_id)}
    assert len(_sent(prefill, transfer_id)) <= sent + len(layers)  # that step's layers only
    assert not [r for r in decode.records("decode.admitted") if r["transfer_id"] == transfer_id]


def test_cancel_between_prefill_and_decode(idle: Cluster) -> None:
    c = idle
    router = PauseDir(c.pause_dir("router"))
    prefill, decode = PauseDir(c.pause_dir(0)), PauseDir(c.pause_dir("decode-0"))
    # the Generate stream is opened alongside the Prefill; held back, the KV arrives first
    router.arm("router.before_generate", request_id="w-between")
    prefill.arm("prefill.transfer_done")
    call = _start(c, "w-between", _prompt(40), 8)
    paused = prefill.wait_paused("prefill.transfer_done", PAUSED_S)
    router.wait_paused("router.before_generate", PAUSED_S)
    try:
        _cancelled(call)
        _router_let_go(c)
        # the KV arrived on the decode worker and waits for a stream: freed without one
        wait_until(lambda: _decode_holds_nothing(c), 20.0, "decode to free the arrived KV")
    finally:
        prefill.release("prefill.transfer_done")
        router.disarm("router.before_generate")
    attempt = paused["attempt_id"]
    assert not [r for r in decode.records("decode.admitted") if r["attempt_id"] == attempt]
    assert not [r for r in decode.records("decode.token") if r["attempt_id"] == attempt]


def test_cancel_while_decoding(idle: Cluster) -> None:
    c = idle
    decode = PauseDir(c.pause_dir("decode-0"))
    decode.arm("decode.token", n=3)
    call = _start(c, "w-decoding", _prompt(40), 200)
    paused = decode.wait_paused("decode.token", PAUSED_S)
    try:
        _cancelled(call)
        _router_let_go(c)  # its Abort waits behind the held decode loop
        time.sleep(0.2)
    finally:
        decode.release("decode.token")
    wait_until(lambda: _decode_holds_nothing(c), 20.0, "decode to stop the stream")
    tokens = [r["n"] for r in decode.records("decode.token")
              if r["attempt_id"] == paused["attempt_id"]]
    assert max(int(n) for n in tokens) <= 4  # token 3 streamed; one step more at most, of 200


def test_cancel_after_the_finish(idle: Cluster) -> None:
    c = idle
    decode = PauseDir(c.pause_dir("decode-0"))
    call = _start(c, "w-finished", _prompt(40), 6)
    responses = list(call)
    assert responses[-1].finish_reason == "length"
    assert sum(len(r.token_ids) for r in responses) == 6
    call.cancel()  # after the end: nothing to stop
    assert call.code() == grpc.StatusCode.OK
    # its last token, recorded once (the loop records it just after handing it over)
    wait_until(lambda: [r for r in decode.records("decode.token") if r["n"] == 6], 10.0,
               "the decode worker's record of the last token")
