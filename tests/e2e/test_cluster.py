"""pdserve end to end: Redis, 2 prefill workers, 1 decode worker with 2 ranks and the
router, all real processes on loopback, driven through ``pdserve.Client``.

Every test ends with the leak check on every worker (``Cluster.assert_no_leaks``). The
test that kills a prefill worker runs last in the module (it changes the cluster).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cluster.internal.v1 import worker_pb2 as wpb
from engine import LLM, SamplingParams
from pdserve.client import Client, PdserveError
from pdserve.v1 import generate_pb2 as pb
from tests.e2e.cluster import NUM_KV_BLOCKS, Cluster, scrape_metrics
from tests.factories import PROMPTS
from tests.processes import wait_until
from tests.worker.kv.faults import CORRUPT_NUM_TOKENS

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT
LONG_PREFIX = " ".join(PROMPTS[3:5] + PROMPTS[3:4])  # > 4 blocks of 16 tokens


# its tests aim prompts at a prefill worker by affinity (``_prompt_routed_to``), which
# kv-aware routing overrides once another worker holds the prompt's prefix
CLUSTER = {"num_prefill": 2, "num_decode": 1, "decode_tp": 2,
           "router_args": ("--prefill-routing", "affinity")}


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir) as engine:
        yield engine


# ------------------------------------------------------------------------ correctness

def test_concurrent_requests_match_llm(client: Client, llm: LLM) -> None:
    texts = [PROMPTS[i % len(PROMPTS)] + " #" * (i // len(PROMPTS)) for i in range(16)]
    texts[5] = LONG_PREFIX + " five"
    # temperature 0.75 is exact in float32, so the proto float carries it unchanged
    params = [SamplingParams(max_tokens=5 + i % 4, temperature=0, ignore_eos=True) if i % 4
              else SamplingParams(max_tokens=6, temperature=0.75, seed=i, ignore_eos=True)
              for i in range(16)]
    expected = llm.generate(texts, params)

    def ask(i: int) -> list[int]:
        p = params[i]
        return list(client.complete(texts[i], max_tokens=p.max_tokens,
                                    temperature=p.temperature, seed=p.seed, ignore_eos=True,
                                    timeout=TIMEOUT_S).token_ids)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert got == [r.token_ids for r in expected]


def test_stream_chunks_text_and_usage(client: Client, llm: LLM) -> None:
    prompt_ids = llm.encode(PROMPTS[1])
    chunks = list(client.generate(prompt_token_ids=prompt_ids, max_tokens=12, temperature=0,
                                  ignore_eos=True, request_id="stream-1", timeout=TIMEOUT_S))
    reference = llm.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))[0]
    assert [c.request_id for c in chunks] == ["stream-1"] * len(chunks)
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert "".join(c.text for c in chunks) == reference.text
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 12)


def test_streamed_text_never_splits_a_character(client: Client, llm: LLM) -> None:
    # sampled at temperature 1.5 the tiny model emits byte-level tokens; find outputs whose
    # tokens split a multi-byte character and check the stream joins them correctly
    tokenizer = llm.tokenizer.tokenizer
    split_seen = False
    for seed in range(12):
        chunks = list(client.generate("日本語 🙂 café", max_tokens=24, temperature=1.5,
                                      seed=seed, ignore_eos=True, timeout=TIMEOUT_S))
        token_ids = [t for c in chunks for t in c.token_ids]
        whole = tokenizer.decode(token_ids)
        streamed = "".join(c.text for c in chunks)
        assert streamed == whole
        assert all(not c.text.endswith("\ufffd") or "\ufffd" in whole for c in chunks)
        per_token = "".join(tokenizer.decode([t]) for t in token_ids)
        split_seen |= per_token.count("\ufffd") > whole.count("\ufffd")
        if split_seen and whole.count("\ufffd") == 0:
            break
    assert split_seen, "no sampled output split a multi-byte character: the test saw nothing"


def test_async_client_concurrent_and_cancelled(cluster: Cluster, client: Client,
                                               llm: LLM) -> None:
    from pdserve.aio_client import AsyncClient

    prompts = PROMPTS[:6]
    expected = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                    ignore_eos=True))

    async def main() -> list[list[int]]:
        async with AsyncClient(cluster.address) as aclient:
            results = await asyncio.gather(*(
                aclient.complete(p, max_tokens=6, temperature=0, ignore_eos=True,
                                 timeout=TIMEOUT_S) for p in prompts))
            stream = aclient.generate("async cancel " * 4, max_tokens=900, ignore_eos=True,
                                      timeout=TIMEOUT_S)
            async for chunk in stream:  # leave after the first chunk: cancels the call
                assert chunk.token_ids
                break
            await stream.aclose()
            return [list(r.token_ids) for r in results]

    assert asyncio.run(main()) == [r.token_ids for r in expected]


# ------------------------------------------------------------------------ routing

def _cached_blocks(cluster: Cluster) -> list[int]:
    return [cluster.info(p).kv.cached_blocks for p in cluster.prefill]


def test_shared_prefix_goes_to_one_prefill_worker(cluster: Cluster, client: Client) -> None:
    before = _cached_blocks(cluster)
    results = [client.complete(f"{LONG_PREFIX} question {i}", max_tokens=2, temperature=0,
                               timeout=TIMEOUT_S) for i in range(4)]
    grew = [a > b for a, b in zip(_cached_blocks(cluster), before, strict=True)]
    cached = [r.usage.cached_tokens for r in results]
    prefix_tokens = results[0].usage.prompt_tokens - 4  # " question i" is a few tokens
    assert all(c >= 16 * (prefix_tokens // 16 - 1) for c in cached[1:]), cached
    assert sum(grew) == 1, (before, _cached_blocks(cluster))  # only one worker cached anything


def test_different_prefixes_spread_over_both_prefill_workers(cluster: Cluster,
                                                             client: Client) -> None:
    before = _cached_blocks(cluster)
    for i in range(12):
        client.complete(f"topic {i * 7919} " + PROMPTS[i % len(PROMPTS)] * 2, max_tokens=1,
                        temperature=0, timeout=TIMEOUT_S)
    after = _cached_blocks(cluster)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_round_robin_prefill_routing_ignores_prefixes(cluster: Cluster, tmp_path: Path) -> None:
    # a second router choosing prefill workers in turn: prompts sharing a prefix go to both
    # (by affinity they would all go to one, as above)
    from tests.processes import spawn

    router = spawn("router-rr", ["router", "--model", str(cluster.model_dir), "--port", "0",
                                 "--redis-url", cluster.redis.url, "--prefill-routing",
                                 "round-robin"], tmp_path).wait_ready()
    started = [cluster.info(p).num_started_requests for p in cluster.prefill]
    try:
        with Client(router.address) as rr:
            for i in range(4):
                rr.complete(f"round robin {LONG_PREFIX} {i}", max_tokens=2, timeout=TIMEOUT_S)
    finally:
        assert router.stop() == 0, router.log_tail()
    now = [cluster.info(p).num_started_requests for p in cluster.prefill]
    assert [b - a for a, b in zip(started, now, strict=True)] == [2, 2]
    cluster.assert_no_leaks()


def test_a_client_that_asks_gets_the_trace(cluster: Cluster) -> None:
    from pdserve.v1 import generate_pb2_grpc

    request = pb.GenerateRequest(text=PROMPTS[0], sampling=pb.SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(cluster.address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request, metadata=(("pdserve-trace", "1"),), timeout=TIMEOUT_S)
        chunks = list(call)
        trailer = dict(call.trailing_metadata())
        plain = stub.Generate(request, timeout=TIMEOUT_S)
        list(plain)
        assert "pdserve-trace" not in dict(plain.trailing_metadata())  # only when asked
    trace = json.loads(trailer["pdserve-trace"])
    assert trailer["pdserve-request-id"] == chunks[0].request_id
    assert trace["attempts"] == 1
    marks = trace["marks_ms"]
    # the Prefill goes out first and the Generate stream right behind it; the first chunk
    # needs no Prefill reply
    order = ["admitted", "turn", "first_call", "prefill_started", "generate_started",
             "first_chunk", "first_sent"]
    assert all(marks[m] is not None and marks[m] >= 0 for m in order + ["prefill_returned"])
    assert [marks[m] for m in order] == sorted(marks[m] for m in order), marks
    # the workers' own durations fit inside what the router saw of their calls
    prefill = trace["prefill_ms"]
    assert all(prefill[k] >= 0 for k in ("queue", "compute", "transfer")) and prefill["compute"] > 0
    assert sum(prefill.values()) <= marks["prefill_returned"] - marks["prefill_started"] + 0.1
    assert 0 < trace["decode_first_chunk_ms"] <= (marks["first_chunk"]
                                                  - marks["generate_started"]) + 0.1
    assert len(trace["relay_ms"]) == len(chunks) and min(trace["relay_ms"]) >= 0


def test_corrupted_kv_is_redispatched(cluster: Cluster, client: Client, llm: LLM) -> None:
    # prefill-0 flips a bit in the first KV transfer of a CORRUPT_NUM_TOKENS-token prompt
    # (test-only fault hook); the decode ranks' checksum catches it, nothing is decoded
    # from it, and the router re-dispatches the request: the client sees correct tokens
    assert cluster.router is not None
    prompt = _prompt_routed_to("prefill-0", CORRUPT_NUM_TOKENS)
    expected = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                     ignore_eos=True))[0].token_ids
    result = client.complete(prompt_token_ids=prompt, max_tokens=4, temperature=0,
                             ignore_eos=True, request_id="corrupted-kv", timeout=TIMEOUT_S)
    assert list(result.token_ids) == expected
    retries = [line for line in cluster.router.log_tail(50_000).splitlines()
               if "request_id=corrupted-kv" in line and " failed, retrying: " in line]
    assert retries, "the router did not retry the corrupted transfer"
    # the decode ranks' checksum caught it (which rank's report the prefill side relays
    # first is a race: the decode leader aborts the transfer on every rank at once)
    caught = [line for w in cluster.decode for line in w.log_tail(200_000).splitlines()
              if "request_id=corrupted-kv" in line and "ChecksumMismatch" in line]
    assert caught, retries


def _prompt_routed_to(worker_id: str, num_tokens: int,
                      workers: tuple[str, ...] = ("prefill-0", "prefill-1")) -> list[int]:
    """A prompt of ``num_tokens`` ids whose prefill affinity (all ``workers`` idle) is
    ``worker_id``, computed with the router's own functions."""
    from engine.kvcache.block_hash import compute_block_hashes
    from router.routing import affinity_key, rendezvous_order

    for salt in range(100):
        prompt = [5 + (7 * i + salt) % 600 for i in range(num_tokens)]
        key = affinity_key(compute_block_hashes(prompt, 16), prompt)
        if rendezvous_order(key, list(workers))[0] == worker_id:
            return prompt
    raise AssertionError("no prompt routes there")


# ------------------------------------------------------------------------ bad input

def _bad_requests() -> list[tuple[str, dict[str, object], str]]:
    """(case, Client.complete keyword arguments, text the error message must contain)."""
    return [
        ("empty text", {"prompt": ""}, "empty"),
        ("empty token ids", {"prompt_token_ids": []}, "empty"),
        ("over context", {"prompt_token_ids": [5] * 2048}, "2048"),
        ("prompt+max_tokens over context", {"prompt_token_ids": [5] * 2000, "max_tokens": 60},
         "2060"),
        ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
        ("max_tokens negative", {"max_tokens": -3}, "max_tokens"),
        ("max_tokens absurd", {"max_tokens": 10**12}, "2048"),
        ("temperature nan", {"temperature": math.nan}, "temperature"),
        ("temperature inf", {"temperature": math.inf}, "temperature"),
        ("temperature negative", {"temperature": -0.5}, "temperature"),
        ("top_p 0", {"top_p": 0.0}, "top_p"),
        ("top_p > 1", {"top_p": 1.5}, "top_p"),
        ("top_k -2", {"top_k": -2}, "top_k"),
        ("too many stops", {"stop": [f"s{i}" for i in range(17)]}, "16"),
        ("empty stop", {"stop": [""]}, "stop"),
        ("long stop", {"stop": ["x" * 257]}, "256"),
        ("token id over vocab", {"prompt_token_ids": [1, 704]}, "704"),
        ("negative token id", {"prompt_token_ids": [-1]}, "vocabulary"),
        ("stop token id over vocab", {"stop_token_ids": [10**6]}, "vocabulary"),
        ("unknown model", {"model": "gpt-17"}, "gpt-17"),
        ("bad request id", {"request_id": "a b"}, "request_id"),
        ("needs more KV blocks than any decode worker", {"prompt_token_ids": [5] * 1000,
                                                          "max_tokens": 100},
         str(NUM_KV_BLOCKS)),
    ]


@pytest.mark.parametrize("case,kwargs,needle", _bad_requests(), ids=[c for c, _, _ in
                                                                   _bad_requests()])
def test_bad_input_is_invalid_argument(client: Client, case: str, kwargs: dict[str, object],
                                       needle: str) -> None:
    args: dict[str, object] = {"prompt": "hello", "max_tokens": 2}
    if "prompt_token_ids" in kwargs:
        args.pop("prompt")
    args.update(kwargs)
    with pytest.raises(PdserveError) as excinfo:
        client.complete(timeout=TIMEOUT_S, **args)  # type: ignore[arg-type]
    assert excinfo.value.code == INVALID, excinfo.value
    assert needle in excinfo.value.details, excinfo.value.details
    assert client.complete("still serving", max_tokens=2, timeout=TIMEOUT_S).finish_reason


def test_top_k_0_considers_every_token_as_vllm_does(client: Client) -> None:
    seeded = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True,
              "timeout": TIMEOUT_S}
    assert client.complete("all tokens", top_k=0, **seeded).text == client.complete(  # type: ignore[arg-type]
        "all tokens", top_k=-1, **seeded).text  # type: ignore[arg-type]


def _raw_generate(cluster: Cluster, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(cluster.address) as channel:
        call = channel.unary_stream("/pdserve.v1.Generation/Generate",
                                    request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as excinfo:
            list(call(payload, timeout=TIMEOUT_S))
    return excinfo.value


def test_malformed_messages_are_refused(cluster: Cluster, client: Client) -> None:
    bad_utf8 = b"\x1a\x02\xff\xfe"  # field 3 (text), 2 bytes that are not UTF-8
    assert _raw_generate(cluster, bad_utf8).code() == INVALID
    internal = wpb.ReserveRequest(client_request_id="x", prompt_token_ids=[1, 2], transfer_id=7)
    error = _raw_generate(cluster, internal.SerializeToString())
    assert error.code() == INVALID and "internal fields" in (error.details() or "")
    # its attempt_id is field 6, the public resume: not a Resume message, so not parsed
    internal.attempt_id = "x"
    assert _raw_generate(cluster, internal.SerializeToString()).code() == INVALID
    oversized = pb.GenerateRequest(text="x" * (5 << 20)).SerializeToString()
    assert _raw_generate(cluster, oversized).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.complete("fine", max_tokens=1, ignore_eos=True,
                           timeout=TIMEOUT_S).finish_reason == "length"


def test_a_request_id_in_flight_elsewhere_is_another_request(cluster: Cluster, client: Client,
                                                              tmp_path: Path) -> None:
    # clients reuse request ids: a second request under an id in flight — on this router
    # or another one — is served as a request of its own (the workers key attempts, never
    # client ids), and the request that holds the id first streams on to its end
    from tests.processes import spawn

    other = spawn("router-dup", ["router", "--model", str(cluster.model_dir), "--port", "0",
                                 "--redis-url", cluster.redis.url], tmp_path).wait_ready()
    try:
        stream = client.generate("first holder " * 4, max_tokens=300, ignore_eos=True,
                                 request_id="dup-id", timeout=TIMEOUT_S)
        received = list(next(stream).token_ids)
        with Client(other.address) as other_client:
            for duplicate in (client, other_client):
                result = duplicate.complete("second", max_tokens=2, ignore_eos=True,
                                            request_id="dup-id", timeout=TIMEOUT_S)
                assert len(result.token_ids) == 2 and result.request_id == "dup-id"
        for chunk in stream:
            received += chunk.token_ids
        assert len(received) == 300
    finally:
        assert other.stop() == 0, other.log_tail()


def test_model_info(client: Client, llama_dir: Path) -> None:
    info = client.model_info(timeout=TIMEOUT_S)
    assert (info.model, info.context_length, info.vocab_size, info.block_size) == \
        (llama_dir.name, 2048, 704, 16)
    assert client.complete("named", model=llama_dir.name, max_tokens=1, ignore_eos=True,
                           timeout=TIMEOUT_S).finish_reason == "length"


def test_health_and_reflection(cluster: Cluster) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(cluster.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service),
                                 timeout=TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "pdserve.v1.Generation" in services and "grpc.health.v1.Health" in services


# ------------------------------------------------------------------------ cancel, deadline, budget

def test_cancel_mid_stream_frees_everything(client: Client) -> None:
    stream = client.generate("cancel me " * 8, max_tokens=900, ignore_eos=True,
                             timeout=TIMEOUT_S)
    first = next(stream)
    assert first.token_ids
    stream.close()  # cancels the call; the fixture's leak check follows


def test_cancel_while_prefilling_frees_everything(cluster: Cluster) -> None:
    # the prefill worker is held (test-only pause point) after computing layer 0 of the
    # request's KV; the client cancels; once released, every worker has freed everything
    from cluster.pause_points import PauseDir

    pause = PauseDir(cluster.pause_dir(0))
    prompt = _prompt_routed_to("prefill-0", 50)
    pause.arm("kv.layer_sent", layer=0)
    with grpc.insecure_channel(cluster.address) as channel:
        call = channel.unary_stream(
            "/pdserve.v1.Generation/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString)(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                   sampling=pb.SamplingParams(max_tokens=20)),
                timeout=TIMEOUT_S)
        try:
            pause.wait_paused("kv.layer_sent", TIMEOUT_S)
            call.cancel()
        finally:
            pause.release("kv.layer_sent")
        assert call.code() == grpc.StatusCode.CANCELLED
    cluster.assert_no_leaks()


def test_client_killed_mid_stream_frees_everything(cluster: Cluster) -> None:
    # the client process dies without cancelling: its connection closes, the router
    # cancels the request, and the workers free everything
    import subprocess
    import sys

    code = ("import sys, pdserve\n"
            "with pdserve.Client(sys.argv[1]) as c:\n"
            "    for chunk in c.generate('vanishing client ' * 4, max_tokens=900,\n"
            "                            ignore_eos=True, timeout=60):\n"
            "        print(len(chunk.token_ids), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, cluster.address],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "1"
    finally:
        proc.kill()
        proc.wait(TIMEOUT_S)
    cluster.assert_no_leaks()


def test_deadline_exceeded_frees_everything(client: Client) -> None:
    with pytest.raises(PdserveError) as excinfo:
        client.complete("slow " * 8, max_tokens=900, ignore_eos=True, timeout=0.5)
    assert excinfo.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_inflight_budget(cluster: Cluster, tmp_path: Path) -> None:
    # a second router on the same cluster, allowed one request at a time
    from tests.processes import spawn

    router = spawn("router-budget", ["router", "--model", str(cluster.model_dir), "--port", "0",
                                     "--redis-url", cluster.redis.url, "--max-inflight", "1"],
                   tmp_path).wait_ready()
    try:
        with Client(router.address) as budget_client:
            stream = budget_client.generate("hold " * 8, max_tokens=900, ignore_eos=True,
                                            timeout=TIMEOUT_S)
            _wait_first_chunk(budget_client, stream)
            start = time.monotonic()
            with pytest.raises(PdserveError) as excinfo:
                budget_client.complete("one too many", max_tokens=2, timeout=TIMEOUT_S)
            assert excinfo.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max-inflight" in excinfo.value.details
            assert time.monotonic() - start < 5.0  # refused at once, not queued
            stream.close()
            time.sleep(0.5)
            assert budget_client.complete("room again", max_tokens=2,
                                          timeout=TIMEOUT_S).finish_reason
    finally:
        assert router.stop() == 0, router.log_tail()
    cluster.assert_no_leaks()


def test_colocated_mode(cluster: Cluster, llm: LLM, tmp_path: Path) -> None:
    # a router in colocated mode: the decode worker prefills every request itself (no
    # prefill worker touched); the tokens are the same
    from tests.processes import spawn

    router = spawn("router-colocated", ["router", "--model", str(cluster.model_dir), "--port",
                                        "0", "--redis-url", cluster.redis.url,
                                        "--local-prefill", "always"], tmp_path).wait_ready()
    prompts = PROMPTS[:4]
    expected = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0,
                                                    ignore_eos=True))
    before = [cluster.info(p).kv for p in cluster.prefill]
    decode_metrics = cluster.decode[0].ready["metrics_address"]
    queued = "pdserve:prefill_queue_seconds_count{}"
    waits_before = scrape_metrics(decode_metrics).get(queued, 0.0)
    try:
        with Client(router.address) as colocated, ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: list(colocated.complete(
                p, max_tokens=6, temperature=0, ignore_eos=True, timeout=TIMEOUT_S).token_ids),
                prompts))
    finally:
        assert router.stop() == 0, router.log_tail()
    assert got == [r.token_ids for r in expected]
    assert [cluster.info(p).kv for p in cluster.prefill] == before  # untouched
    assert router.log_tail().count("prefilling locally on decode-0 (colocated mode)") == 4
    # each local prefill's queue wait is counted, as a prefill worker's is (the planner
    # reads it to see a colocated cluster's prompts queue)
    assert scrape_metrics(decode_metrics)[queued] == waits_before + 4
    cluster.assert_no_leaks()


def test_queued_token_budget(cluster: Cluster, tmp_path: Path) -> None:
    # a router allowing 100 prompt tokens before their first token: while an 80-token
    # prompt is held mid-prefill (pause point), a 40-token one is refused at once; once
    # the first has its first token, the second is admitted
    from cluster.pause_points import PauseDir
    from tests.processes import spawn

    router = spawn("router-queued", ["router", "--model", str(cluster.model_dir), "--port",
                                     "0", "--redis-url", cluster.redis.url,
                                     "--max-queued-tokens", "100"], tmp_path).wait_ready()
    pause = PauseDir(cluster.pause_dir(0))
    held = _prompt_routed_to("prefill-0", 80)
    pause.arm("kv.layer_sent", layer=0)
    try:
        with Client(router.address) as budget, ThreadPoolExecutor(1) as pool:
            first = pool.submit(budget.complete, prompt_token_ids=held, max_tokens=2,
                                timeout=TIMEOUT_S)
            try:
                pause.wait_paused("kv.layer_sent", TIMEOUT_S)
                with pytest.raises(PdserveError) as excinfo:
                    budget.complete(prompt_token_ids=[7] * 40, max_tokens=2, timeout=TIMEOUT_S)
                assert excinfo.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-queued-tokens 100" in excinfo.value.details
            finally:
                pause.release("kv.layer_sent")
            assert first.result(TIMEOUT_S).finish_reason
            assert budget.complete(prompt_token_ids=[7] * 40, max_tokens=2,
                                   timeout=TIMEOUT_S).finish_reason
    finally:
        assert router.stop() == 0, router.log_tail()
    cluster.assert_no_leaks()


def _wait_first_chunk(client: Client, stream: Iterator[object]) -> None:
    done = threading.Event()
    first: list[object] = []

    def pull() -> None:
        first.append(next(stream))  # type: ignore[call-overload]
        done.set()

    threading.Thread(target=pull, daemon=True).start()
    assert done.wait(TIMEOUT_S) and first


# ------------------------------------------------------------------------ faults

def test_router_killed_mid_stream(cluster: Cluster, tmp_path: Path) -> None:
    # the client sees UNAVAILABLE; the workers notice the broken streams and free everything
    from tests.processes import spawn

    router = spawn("router-doomed", ["router", "--model", str(cluster.model_dir), "--port", "0",
                                     "--redis-url", cluster.redis.url], tmp_path).wait_ready()
    with Client(router.address) as doomed:
        stream = doomed.generate("doomed " * 8, max_tokens=900, ignore_eos=True,
                                 timeout=TIMEOUT_S)
        _wait_first_chunk(doomed, stream)
        router.stop(sig=9)
        with pytest.raises(PdserveError) as excinfo:
            for _ in stream:
                pass
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    cluster.assert_no_leaks()


def test_redis_restart_keeps_traffic_flowing(cluster: Cluster, client: Client) -> None:
    # Redis loses everything; the router keeps its last-known-good view, the workers
    # register again within a heartbeat, and no request fails meanwhile
    errors: list[BaseException] = []
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            try:
                client.complete("keep going", max_tokens=2, timeout=TIMEOUT_S)
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    time.sleep(0.5)
    cluster.redis.restart()
    time.sleep(2.0)  # several heartbeats and router refreshes
    done.set()
    thread.join(TIMEOUT_S)
    assert not errors, errors
    from cluster.registry import Registry

    with Registry(cluster.redis.url) as registry:
        names = {r.worker_id for r in registry.list_workers()}
    assert names == {w.name for w in cluster.workers()}


def test_prefill_worker_killed_mid_prefill(cluster: Cluster, client: Client, llm: LLM,
                                           tmp_path: Path) -> None:
    # a third prefill worker, paused (test-only pause point) once it computed and queued
    # layer 0 of a request's KV, is SIGKILLed there: the router retries the request on
    # another prefill worker and the client gets the right tokens
    from cluster.pause_points import ENV, PauseDir

    assert cluster.router is not None
    router = cluster.router
    pause = PauseDir(tmp_path)
    victim = cluster.start_worker("prefill", 2, env={ENV: str(tmp_path)}).wait_ready()
    wait_until(lambda: "worker prefill-2 is serving" in router.log_tail(50_000), 30.0,
               "the router to route to prefill-2")
    prompt = _prompt_routed_to("prefill-2", 40, ("prefill-0", "prefill-1", "prefill-2"))
    expected = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                     ignore_eos=True))[0].token_ids
    pause.arm("kv.layer_sent", layer=0)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.complete, prompt_token_ids=prompt, max_tokens=4,
                             temperature=0, ignore_eos=True, request_id="mid-prefill",
                             timeout=TIMEOUT_S)
        pause.wait_paused("kv.layer_sent", TIMEOUT_S)
        victim.stop(sig=signal.SIGKILL)
        result = future.result(TIMEOUT_S)
    assert list(result.token_ids) == expected
    assert any("request_id=mid-prefill" in line and "prefill on prefill-2" in line
               for line in router.log_tail(50_000).splitlines())


def test_hung_prefill_worker_is_routed_around(cluster: Cluster, client: Client) -> None:
    # SIGSTOP: the worker stops answering health checks; requests waiting on it are taken
    # back and retried elsewhere (well before their deadline), new ones avoid it
    assert cluster.router is not None
    victim = cluster.prefill[0]
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        def ask(i: int) -> tuple[int, float]:
            start = time.monotonic()
            result = client.complete(f"while hung {i} " + PROMPTS[i], max_tokens=2,
                                     temperature=0, timeout=TIMEOUT_S)
            return len(result.token_ids), time.monotonic() - start

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(ask, range(8)))
        assert all(n == 2 for n, _ in results), results
        assert max(s for _, s in results) < TIMEOUT_S / 2, results  # not held until the deadline
        assert f"worker {victim.name} is not serving" in cluster.router.log_tail(50_000)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: f"worker {victim.name} is serving" in
               cluster.router.log_tail(50_000).rpartition("is not serving")[2], 30.0,
               "the router to route to the resumed worker again")


# ------------------------------------------------------------------------ (last: kills a worker)

def test_killed_prefill_worker_is_routed_around(cluster: Cluster, client: Client) -> None:
    victim = cluster.prefill[1]
    victim.stop(sig=9)
    # every prompt succeeds, also those whose affinity points at the dead worker
    for i in range(8):
        result = client.complete(f"after the kill {i} " + PROMPTS[i], max_tokens=3,
                                 temperature=0, timeout=TIMEOUT_S)
        assert result.finish_reason == "length" and len(result.token_ids) == 3
    # the dead worker was still registered (its TTL had not passed): it was tried, failed
    # to connect, and the request went on to the other worker
    assert cluster.router is not None
    assert f"not routing to {victim.name}" in cluster.router.log_tail(50_000)


def test_no_prefill_worker_left(cluster: Cluster, client: Client, llm: LLM,
                                tmp_path: Path) -> None:
    # every prefill worker dead: the default router answers UNAVAILABLE, one with
    # --local-prefill fallback has the decode worker prefill locally
    from tests.processes import spawn

    for worker in cluster.prefill:
        worker.stop(sig=9)
    fallback = spawn("router-fallback", ["router", "--model", str(cluster.model_dir), "--port",
                                         "0", "--redis-url", cluster.redis.url,
                                         "--local-prefill", "fallback"], tmp_path).wait_ready()
    expected = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=5, temperature=0,
                                                         ignore_eos=True))[0].token_ids
    try:
        with Client(fallback.address) as other:
            result = other.complete(PROMPTS[2], max_tokens=5, temperature=0, ignore_eos=True,
                                    timeout=TIMEOUT_S)
        assert list(result.token_ids) == expected
    finally:
        assert fallback.stop() == 0, fallback.log_tail()
    with pytest.raises(PdserveError) as excinfo:
        client.complete(PROMPTS[2], max_tokens=5, timeout=TIMEOUT_S)
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    assert "prefill" in excinfo.value.details, excinfo.value.details
    # a new prefill worker joins: the default router routes to it again
    assert cluster.router is not None
    router = cluster.router
    cluster.start_worker("prefill", 3).wait_ready()
    wait_until(lambda: "worker prefill-3 is serving" in router.log_tail(100_000), 30.0,
               "the router to route to prefill-3")
    assert list(client.complete(PROMPTS[2], max_tokens=5, temperature=0, ignore_eos=True,
                                timeout=TIMEOUT_S).token_ids) == expected


def test_killed_decode_worker_mid_stream_is_unavailable(cluster: Cluster) -> None:
    # the tokens already streamed stay streamed; then UNAVAILABLE, never a silent end (the
    # only decode worker is gone: no migration; the client does not resume)
    with Client(cluster.address, max_resumes=0) as client:
        stream = client.generate("until the decode worker dies " * 3, max_tokens=900,
                                 ignore_eos=True, timeout=TIMEOUT_S)
        received = list(next(stream).token_ids)
        cluster.decode[0].stop(sig=9)
        with pytest.raises(PdserveError) as excinfo:
            for chunk in stream:
                received += chunk.token_ids
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    assert 1 <= len(received) < 900
    assert "streamed tokens" in excinfo.value.details, excinfo.value.details
    # which worker it was, and what its channel said, stay in the router's log
    assert "decode-0" not in excinfo.value.details and "127.0.0.1" not in excinfo.value.details
    assert cluster.router is not None
    router = cluster.router
    wait_until(lambda: re.search(r"failed after \d+ streamed tokens \(decode-0: ",
                                 router.log_tail(100_000)), 10.0,
               "the router to log which worker failed")
