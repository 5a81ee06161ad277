"""The edges a code review found (issue 24's defects), each through the public APIs of a
real cluster: the SDK and raw gRPC on the router's port, ``httpx2`` on its HTTP port.

The cluster's prefill worker holds only ``PREFILL_BLOCKS`` KV blocks (a prompt larger than
that is refused before any work) and the router admits ``MAX_INFLIGHT`` requests at once
(a burst far past it must end OK or RESOURCE_EXHAUSTED, nothing else). Every test ends
with the cluster-wide leak check (workers, the router's holdings, Redis).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import httpx2
import pytest

from pdserve.client import Client, PdserveError
from pdserve.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.cluster import Cluster
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(300)

PREFILL_BLOCKS = 8  # of 16 tokens: prompts up to 128 tokens
MAX_INFLIGHT = 8
TIMEOUT_S = 60.0
QUICK_S = 10.0  # a refusal answers well within this

CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1,
           "prefill_args": ("--num-kv-blocks", str(PREFILL_BLOCKS)),
           "decode_kv_blocks": 256,
           "router_args": ("--http-port", "0", "--max-inflight", str(MAX_INFLIGHT))}


def http_url(cluster: Cluster) -> str:
    assert cluster.router is not None
    return f"http://{cluster.router.ready['http_address']}"


def assert_serves(client: Client) -> None:
    """The next ordinary request succeeds."""
    done = client.complete(PROMPTS[0], max_tokens=4, temperature=0, ignore_eos=True,
                           timeout=TIMEOUT_S)
    assert len(done.token_ids) == 4


# ------------------------------------------------------------------------- deadlines

def test_a_deadline_past_the_maximum_is_refused_on_http(cluster: Cluster,
                                                        client: Client) -> None:
    started = time.monotonic()
    reply = httpx2.post(http_url(cluster) + "/v1/completions", timeout=QUICK_S,
                        headers={"X-Request-Timeout": "1e17"},
                        json={"model": "", "prompt": PROMPTS[0], "max_tokens": 4})
    assert reply.status_code == 400, reply.text
    assert "(0, 86400]" in reply.json()["error"]["message"]
    assert time.monotonic() - started < QUICK_S
    assert_serves(client)


def test_a_deadline_past_the_maximum_is_refused_on_grpc(client: Client) -> None:
    with pytest.raises(PdserveError) as caught:
        client.complete(PROMPTS[0], max_tokens=4, timeout=30 * 86400.0)  # 30 days
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most" in caught.value.details
    assert_serves(client)


# ---------------------------------------------------------------------- temperatures

def test_a_tiny_temperature_is_greedy_on_both_apis(cluster: Cluster, client: Client) -> None:
    greedy = client.complete(PROMPTS[3], max_tokens=8, temperature=0, ignore_eos=True,
                             timeout=TIMEOUT_S)
    assert len(set(greedy.token_ids)) > 1  # a real continuation, not one token repeated
    tiny = client.complete(PROMPTS[3], max_tokens=8, temperature=1e-40, ignore_eos=True,
                           timeout=TIMEOUT_S)
    assert tiny.token_ids == greedy.token_ids
    reply = httpx2.post(http_url(cluster) + "/v1/completions", timeout=TIMEOUT_S, json={
        "model": "", "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 1e-40,
        "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == greedy.text


# --------------------------------------------------------------------- stop token ids

def test_a_flood_of_stop_token_ids_is_refused_at_once(client: Client) -> None:
    # ~3.9 MiB of one-byte ids: just under the router's public 4 MiB message limit
    started = time.monotonic()
    with pytest.raises(PdserveError) as caught:
        client.complete(PROMPTS[0], max_tokens=4, stop_token_ids=[5] * 3_900_000,
                        timeout=TIMEOUT_S)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "1024 stop_token_ids" in caught.value.details
    assert time.monotonic() - started < QUICK_S
    assert_serves(client)


def cluster_vocab(client: Client) -> int:
    return client.model_info(timeout=TIMEOUT_S).vocab_size


def test_the_most_stop_token_ids_allowed_still_stop(client: Client) -> None:
    greedy = client.complete(PROMPTS[3], max_tokens=8, temperature=0, ignore_eos=True,
                             timeout=TIMEOUT_S)
    third = greedy.token_ids[2]
    others = [i for i in range(cluster_vocab(client)) if i not in greedy.token_ids[:3]][:1023]
    stopped = client.complete(PROMPTS[3], max_tokens=8, temperature=0, ignore_eos=True,
                              stop_token_ids=[*others, third], timeout=TIMEOUT_S)
    assert stopped.token_ids == greedy.token_ids[:3]
    assert stopped.finish_reason == "stop"


# -------------------------------------------------------------------- what cannot fit

def test_a_prompt_larger_than_every_prefill_pool_is_refused_before_any_work(
        cluster: Cluster, client: Client) -> None:
    prompt = [1 + i % 300 for i in range(PREFILL_BLOCKS * 16 + 1)]
    with pytest.raises(PdserveError) as caught:
        client.complete(prompt_token_ids=prompt, max_tokens=4, timeout=TIMEOUT_S)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the largest prefill worker holds {PREFILL_BLOCKS}" in caught.value.details
    # one token fewer fits
    done = client.complete(prompt_token_ids=prompt[:-1], max_tokens=2, ignore_eos=True,
                           timeout=TIMEOUT_S)
    assert len(done.token_ids) == 2


# ----------------------------------------------------------------------------- chats

def test_a_chat_of_too_many_messages_is_refused_before_it_renders(cluster: Cluster,
                                                                   client: Client) -> None:
    messages = [{"role": "user", "content": "hi"}] * 5000
    started = time.monotonic()
    reply = httpx2.post(http_url(cluster) + "/v1/chat/completions", timeout=QUICK_S,
                        json={"model": "", "messages": messages, "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    assert "at most 4096 messages" in reply.json()["error"]["message"]
    assert time.monotonic() - started < QUICK_S
    assert_serves(client)


# ----------------------------------------------------------------------------- burst

async def _burst(address: str, num_calls: int) -> Counter[str]:
    """``num_calls`` concurrent streams on one channel; the status each ended with."""
    request = generate_pb2.GenerateRequest(text=PROMPTS[0], sampling=generate_pb2.SamplingParams(
        max_tokens=2, temperature=0.0, top_p=1.0, top_k=-1))

    async def one(stub: generate_pb2_grpc.GenerationStub) -> str:
        try:
            async for _ in stub.Generate(request, timeout=TIMEOUT_S):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return Counter(await asyncio.gather(*(one(stub) for _ in range(num_calls))))


def test_a_burst_past_grpc_s_pending_call_limit_is_answered_ok_or_refused(
        cluster: Cluster, client: Client) -> None:
    # gRPC core cancels calls past its default 1,000 pending: none of these may be CANCELLED
    outcomes = asyncio.run(_burst(cluster.address, 1500))
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["OK"] >= MAX_INFLIGHT, outcomes
    assert_serves(client)

