"""The Prefill sent together with the Reserve, through real processes (Redis, one prefill
and one decode worker that holds one request at a time, a router routing kv-aware):

- a prompt the decode worker holds none of: the router starts the Prefill's call, then
  the Reserve's, before the Reserve's reply (the trace's marks say so) and the tokens
  are ``engine.LLM``'s;
- the next turn of that prompt, whose prefix the decode worker holds: the router waits for
  the reply, which says which blocks to skip; the decode worker reuses them and the
  tokens are ``engine.LLM``'s;
- a next turn sent before the router's KV index lists its prefix (the decode worker's KV
  events held back): the router saw that KV land, waits for the reply, and the decode
  worker reuses the blocks;
- two requests at once: the second's Reserve is refused (the worker holds its one request)
  after its Prefill went out; the Prefill is aborted, the transfer refused, the request is
  placed again once there is room, and both get ``engine.LLM``'s tokens;
- a Reserve sent with its Prefill that fails refuses its transfer id: KV for it is dropped
  and the id can never be reserved.

Every test ends with the cluster's leak check.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.internal.v1 import worker_pb2 as wpb
from cluster.pause_points import PauseDir
from engine import LLM, SamplingParams
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from tests.e2e.cluster import Cluster, scrape_metrics
from tests.processes import Proc, wait_until

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
BLOCK = 16  # the workers' --block-size
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1,
           "router_args": ("--metrics-port", "0"), "decode_args": ("--max-requests", "1")}
FIRST = [(7 * i + 3) % 200 + 5 for i in range(40)]  # 2 full blocks and 8 tokens
NEXT = FIRST + [(11 * i + 1) % 200 + 5 for i in range(30)]  # the next turn: FIRST, then more


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir) as engine:
        yield engine


def _metric(proc: Proc, name: str) -> float:
    return scrape_metrics(proc.ready["metrics_address"]).get(name, 0.0)


def _traced(address: str, prompt: list[int], max_tokens: int) -> tuple[list[int], dict[str, Any]]:
    """The greedy tokens of ``prompt`` through the router, and the request's trace."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(
            request, metadata=(("pdserve-trace", "1"),), timeout=TIMEOUT_S)
        tokens = [t for chunk in call for t in chunk.token_ids]
        trailer = dict(call.trailing_metadata())
    return tokens, json.loads(trailer["pdserve-trace"])


def _expected(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return list(llm.generate([prompt], params)[0].token_ids)


def _asks_what_to_skip_and_reuses(cluster: Cluster, llm: LLM, prompt: list[int],
                                  expected: list[int] | None = None) -> None:
    """``prompt``, whose first two blocks the decode worker holds, through the router: the
    Reserve's reply (what to skip) comes before the Prefill goes out, the worker reuses
    them, and the tokens are ``engine.LLM``'s (``expected``, if computed already)."""
    decode = cluster.decode[0]
    reused = _metric(decode, "pdserve:kv_blocks_reused_total{}")
    tokens, trace = _traced(cluster.address, prompt, 6)
    assert tokens == (expected if expected is not None else _expected(llm, prompt, 6))
    marks = trace["marks_ms"]
    assert marks["reserve_sent"] < marks["reserved"] < marks["prefill_started"], marks
    assert _metric(decode, "pdserve:kv_blocks_reused_total{}") - reused >= 2


def test_the_prefill_goes_out_with_the_reserve_unless_the_decode_worker_holds_a_prefix(
        cluster: Cluster, llm: LLM) -> None:
    router, decode = cluster.router, cluster.decode[0]
    assert router is not None
    wait_until(lambda: _metric(router, "pdserve:router_kv_index_trusted{}") == 1, 30.0,
               "the router to trust its KV index")
    tokens, trace = _traced(cluster.address, FIRST, 6)
    assert tokens == _expected(llm, FIRST, 6)
    marks = trace["marks_ms"]
    assert trace["attempts"] == 1
    assert marks["first_call"] <= marks["prefill_started"] <= marks["reserve_sent"] \
        < marks["reserved"], marks
    # the decode worker now holds FIRST's full blocks (and the router's index says so)
    blocks = f"pdserve:router_kv_index_worker_blocks{{worker={decode.name}}}"
    wait_until(lambda: _metric(router, blocks) >= 2, 30.0, "the index to list decode-0's blocks")
    _asks_what_to_skip_and_reuses(cluster, llm, NEXT)


def test_a_next_turn_the_index_does_not_list_yet_still_reuses_the_decode_workers_blocks(
        cluster: Cluster, llm: LLM) -> None:
    router, decode = cluster.router, cluster.decode[0]
    assert router is not None
    first = [(5 * i + 2) % 300 + 5 for i in range(40)]  # 2 full blocks, none held yet
    following = first + [(3 * i + 8) % 300 + 5 for i in range(30)]
    wait_until(lambda: _metric(router, "pdserve:router_kv_index_trusted{}") == 1, 30.0,
               "the router to trust its KV index")
    expected = _expected(llm, first, 6), _expected(llm, following, 6)
    events = PauseDir(cluster.pause_dir(decode.name))
    events.arm("kv_events.publish")  # the decode worker's next batch (first's blocks) waits
    try:
        tokens, _ = _traced(cluster.address, first, 6)
        events.wait_paused("kv_events.publish", TIMEOUT_S)
        # at once (the router's note of first's KV lasts 2 s): by the index the worker
        # holds none of it, but the router saw first's KV land there
        _asks_what_to_skip_and_reuses(cluster, llm, following, expected[1])
        assert tokens == expected[0]
    finally:
        events.disarm("kv_events.publish")
        events.release("kv_events.publish")


def test_a_reserve_refused_after_its_prefill_went_out_is_placed_again(
        cluster: Cluster, llm: LLM) -> None:
    router = cluster.router
    assert router is not None
    prompts = [[(13 * i + 7 * k) % 300 + 5 for i in range(90 + 17 * k)] for k in range(2)]
    aborted_ahead = "its Prefill, sent ahead, is aborted"
    seen = router.log_path.read_text(errors="replace").count(aborted_ahead)
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(_traced, cluster.address, p, 40) for p in prompts]
        results = [r.result(timeout=TIMEOUT_S) for r in runs]
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == _expected(llm, prompt, 40)
    # one of them was refused (the decode worker holds one request at a time) after its
    # Prefill went out, and was placed again
    assert router.log_path.read_text(errors="replace").count(aborted_ahead) > seen


def test_a_failed_reserve_sent_with_its_prefill_refuses_its_transfer(cluster: Cluster) -> None:
    decode = cluster.stub(cluster.decode[0])
    sampling = wpb.SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=-1)

    def reserve(attempt: str, prompt: list[int]) -> None:
        decode.Reserve(wpb.ReserveRequest(
            client_request_id=attempt, attempt_id=attempt, prompt_token_ids=prompt,
            sampling=sampling, transfer_id=987_654, wait_ms=5_000, expected_cached_blocks=0),
            timeout=TIMEOUT_S)

    with pytest.raises(grpc.RpcError) as bad:
        reserve("ahead-bad", [10**9])  # no such token: refused before anything is held
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as again:  # the transfer id was refused with it
        reserve("ahead-again", FIRST)
    assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "was refused here before" in (again.value.details() or ""), again.value.details()
