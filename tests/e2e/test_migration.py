"""Streams that outlive the process serving them: one prefill and two decode workers and
two routers, real processes. A decode worker SIGKILLed mid-stream under 16 concurrent
streams, then a router SIGKILLed mid-stream under streams of an SDK client given both
routers: every stream must come out whole and right — greedy and seeded tokens, text and
stop strings equal to ``engine.LLM``'s unfaulted run, usage counting the whole output —
with the migrations counted, and nothing held afterwards (the module's leak check: the
dead router's attempts are freed once their leases lapse). With ``--migration-limit 0``
a decode death is UNAVAILABLE naming the streamed tokens; a resume whose token does not
seal the request and the tokens it names is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput
from pdserve import AsyncClient, Client, PdserveError
from tests.e2e.cluster import Cluster
from tests.factories import PROMPTS
from tests.processes import Proc

pytestmark = pytest.mark.timeout(300)

# a structured output long enough to be in flight when its decode worker dies
SCHEMA = {"type": "object", "properties": {"words": {
    "type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
    "minItems": 12, "maxItems": 20}}, "required": ["words"], "additionalProperties": False}

TIMEOUT_S = 120.0
MAX_TOKENS = 256
LONG = 900
KILL_AFTER = 16  # every stream has this many tokens when the worker dies
CLUSTER = {"num_prefill": 1, "num_decode": 2, "decode_tp": 1, "decode_kv_blocks": 400,
           "router_args": ("--metrics-port", "0"), "lease_ttl_s": 3.0}


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir) as engine:
        yield engine


def _streams(llm: LLM) -> tuple[list[str], list[SamplingParams]]:
    """16 streams: 12 greedy (4 of them with penalties and min_tokens, 4 with a stop
    string that matches late in their output, after the migration, 2 with logprobs), 4
    seeded sampling (2 with penalties, 1 held to a JSON Schema)."""
    prompts = [f"{PROMPTS[i % 4]} (stream {i})" for i in range(16)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
              if i < 12 else SamplingParams(max_tokens=MAX_TOKENS, temperature=0.75, seed=i,
                                            ignore_eos=True) for i in range(16)]
    for i in (4, 5, 6, 7, 14, 15):  # penalties count the output so far across a move
        params[i] = replace(params[i], presence_penalty=0.5, frequency_penalty=0.25,
                            repetition_penalty=1.25, min_tokens=MAX_TOKENS // 2)
    for i in (2, 3):  # logprobs go on where they broke (the first after it: the prefill's)
        params[i] = replace(params[i], logprobs=2)
    params[13] = replace(params[13], structured=StructuredOutput("json", json.dumps(SCHEMA)))
    free = llm.generate(prompts[8:12], params[8:12])
    for i, result in zip(range(8, 12), free, strict=True):
        cut = len(result.text) * 3 // 4  # a stop string of the output's last quarter
        stop = result.text[cut:cut + 6]
        if len(stop.strip()) >= 2:
            params[i] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                       stop=(stop,))
    return prompts, params


def _sdk(p: SamplingParams) -> dict[str, object]:
    """``p`` as the SDK's keyword arguments (the values exact in float32)."""
    extra: dict[str, object] = {}
    if p.logprobs is not None:
        extra["logprobs"] = p.logprobs
    if p.structured is not None:
        extra["structured_outputs"] = {p.structured.kind: p.structured.spec}
    return dict(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed,
                stop=list(p.stop), ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                min_tokens=p.min_tokens, timeout=TIMEOUT_S, **extra)


def _router_b(cluster: Cluster) -> Proc:
    """The module's second router (started on first use, with metrics)."""
    live = [r for r in cluster.routers if r.name == "router-b" and r.proc.poll() is None]
    return live[0] if live else cluster.start_router("--metrics-port", "0", name="router-b")


def _metrics(cluster: Cluster, router: Proc | None = None) -> dict[str, float]:
    """A router's metrics (default: the module's): ``name{labels}`` → value."""
    router = router or cluster.router
    assert router is not None
    address = router.ready["metrics_address"]
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def _holding(cluster: Cluster) -> dict[str, int]:
    """Attempts each live decode worker holds."""
    return {w.name: len(cluster.info(w).attempt_ids) for w in cluster.decode
            if w.proc.poll() is None}


NEW_WORKERS = itertools.count(2)  # decode-2, decode-3, ...: the replacements


def _replace(cluster: Cluster, dead: Proc) -> None:
    """A new decode worker in place of ``dead``, serving once the router sees it (the
    dead one's record lapses meanwhile: the leak check waits for Redis to match)."""
    cluster.decode.remove(dead)
    cluster.start_worker("decode", next(NEW_WORKERS), "--num-kv-blocks", "400").wait_ready()
    cluster.wait_serving()


def test_sixteen_streams_survive_their_decode_worker_killed_mid_stream(
        cluster: Cluster, llm: LLM) -> None:
    prompts, params = _streams(llm)
    expected = llm.generate(prompts, params)
    assert sum(1 for p in params if p.stop) >= 2  # stop strings are in flight
    received: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    texts = ["" for _ in prompts]
    victim = cluster.decode[0]
    held: dict[str, int] = {}
    ends_of: list[str | None] = [None for _ in prompts]  # finish reasons, once finished

    async def one(client: AsyncClient, i: int) -> tuple[str | None, object]:
        finish, usage = None, None
        async for chunk in client.generate(prompts[i], **_sdk(params[i])):  # type: ignore[arg-type]
            received[i] += chunk.token_ids
            logprobs[i] += [lp.logprob for lp in chunk.logprobs]
            texts[i] += chunk.text
            finish, usage = chunk.finish_reason or finish, chunk.usage or usage
        ends_of[i] = finish
        return finish, usage

    async def kill_when_all_have_streamed() -> None:
        while any(len(r) < KILL_AFTER and ends_of[i] is None for i, r in enumerate(received)):
            await asyncio.sleep(0.005)
        held.update(await asyncio.to_thread(_holding, cluster))
        victim.stop(sig=9)

    async def run() -> list[tuple[str | None, object]]:
        async with AsyncClient(cluster.address) as client:
            killer = asyncio.ensure_future(kill_when_all_have_streamed())
            try:
                return await asyncio.gather(*(one(client, i) for i in range(16)))
            finally:
                killer.cancel()

    async def warm_up() -> None:  # each decode worker builds its grammar compiler first
        async with AsyncClient(cluster.address) as client:
            await asyncio.gather(*(client.complete(prompts[13], **_sdk(replace(  # type: ignore[arg-type]
                params[13], max_tokens=24, seed=s))) for s in range(2)))

    asyncio.run(warm_up())  # (built on first use, it would hold one worker's streams back)
    before = _metrics(cluster)
    ends = asyncio.run(run())
    assert victim.proc.poll() is not None and held.get(victim.name, 0) >= 1, held
    for i, result in enumerate(expected):
        assert received[i] == result.token_ids, i  # nothing twice, nothing missing
        assert texts[i] == result.text, i
        if result.logprobs is not None:
            assert logprobs[i] == pytest.approx([lp.logprob for lp in result.logprobs],
                                                abs=1e-4), i
        finish, usage = ends[i]
        assert finish == result.finish_reason, i
        assert usage is not None and usage.completion_tokens == len(result.token_ids), i
        assert usage.prompt_tokens == len(result.prompt_token_ids), i
    assert sum(1 for e, p in zip(expected, params, strict=True)
               if p.stop and e.finish_reason == "stop") >= 2
    assert ends[13][0] == "stop" and len(received[13]) > KILL_AFTER  # moved mid-grammar
    jsonschema.validate(json.loads(texts[13]), SCHEMA)
    after = _metrics(cluster)
    migrated = sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k.startswith("pdserve:migrations_total"))
    # every stream the victim held was migrated (those that ended in the meantime not)
    assert 1 <= migrated <= held[victim.name], (migrated, held)
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    # each migrated stream's gap is timed at its next token — unless the stream failed
    # again before it (e.g. no worker could take it at once) and the SDK resumed it
    stalls = delta("pdserve:migration_stall_seconds_count")
    resumed = delta("pdserve:router_resumed_streams_total")
    assert cluster.router is not None
    assert stalls <= migrated <= stalls + resumed, (
        stalls, migrated, resumed, [line for line in cluster.router.log_tail(200_000).splitlines()
                                    if "WARNING" in line and "abort of" not in line][-40:])
    assert "migrating (1 of 3)" in cluster.router.log_tail(200_000)
    _replace(cluster, victim)


def test_with_migration_off_a_decode_death_is_unavailable_and_frees_all(
        cluster: Cluster) -> None:
    router = cluster.start_router("--migration-limit", "0", name="router-no-migration")
    try:
        with Client(router.address, max_resumes=0) as client:  # the router's answer
            # long enough to outlast the kill below
            stream = client.generate(f"{PROMPTS[3]} no migration", max_tokens=LONG,
                                     ignore_eos=True, timeout=TIMEOUT_S)
            received = list(next(stream).token_ids)
            (victim,) = [w for w in cluster.decode if _holding(cluster).get(w.name)]
            victim.stop(sig=9)
            with pytest.raises(PdserveError) as caught:
                for chunk in stream:
                    received += chunk.token_ids
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert "streamed tokens" in caught.value.details, caught.value.details
        assert victim.name not in caught.value.details
        assert 1 <= len(received) < LONG
    finally:
        router.stop()
    cluster.routers.remove(router)
    _replace(cluster, victim)



def test_streams_resume_on_the_other_router_when_theirs_is_killed(
        cluster: Cluster, llm: LLM) -> None:
    cluster.with_router()
    other = _router_b(cluster)
    prompts, params = _streams(llm)
    prompts, params = prompts[4:12], params[4:12]  # 4 greedy, 4 greedy with a stop string
    prompts += [f"{PROMPTS[1]} resumed {i}" for i in range(2)]
    params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.75, seed=40 + i,
                              ignore_eos=True) for i in range(2)]
    expected = llm.generate(prompts, params)
    received: list[list[int]] = [[] for _ in prompts]
    texts = ["" for _ in prompts]
    done: set[int] = set()
    victim = cluster.router
    assert victim is not None
    served_by_victim = [0]

    async def one(client: AsyncClient, i: int) -> object:
        usage = None
        async for chunk in client.generate(prompts[i], **_sdk(params[i])):  # type: ignore[arg-type]
            received[i] += chunk.token_ids
            texts[i] += chunk.text
            usage = chunk.usage or usage
        done.add(i)
        return usage

    async def kill_when_all_have_streamed() -> None:
        while any(len(r) < KILL_AFTER and i not in done for i, r in enumerate(received)):
            await asyncio.sleep(0.005)
        # the streams the victim serves: calls go to the two routers in turn
        served_by_victim[0] = sum(1 for i in range(0, len(prompts), 2) if i not in done)
        victim.stop(sig=9)

    async def run() -> list[object]:
        async with AsyncClient([victim.address, other.address]) as client:
            killer = asyncio.ensure_future(kill_when_all_have_streamed())
            try:
                return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
            finally:
                killer.cancel()

    before = _metrics(cluster, other).get("pdserve:router_resumed_streams_total", 0.0)
    usages = asyncio.run(run())
    assert victim.proc.poll() is not None
    for i, result in enumerate(expected):
        assert received[i] == result.token_ids, i  # nothing twice, nothing missing
        assert texts[i] == result.text, i
        assert usages[i].completion_tokens == len(result.token_ids), i  # type: ignore[attr-defined]
    after = _metrics(cluster, other)["pdserve:router_resumed_streams_total"]
    assert served_by_victim[0] >= 1
    assert after - before == served_by_victim[0]  # each broken stream resumed once
    cluster.with_router()  # the module's router again; router-b stays for the next test


def test_a_resume_is_refused_unless_its_token_seals_the_request_and_tokens(
        cluster: Cluster, llm: LLM) -> None:
    from pdserve.v1 import generate_pb2 as gpb
    from pdserve.v1 import generate_pb2_grpc as gpb_grpc

    other = _router_b(cluster)
    request = gpb.GenerateRequest(text=f"{PROMPTS[0]} sealed", sampling=gpb.SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True))
    (expected,) = llm.generate([request.text], SamplingParams(max_tokens=24, temperature=0.0,
                                                              ignore_eos=True))
    with grpc.insecure_channel(cluster.address) as channel:  # three messages, then gone
        stream = gpb_grpc.GenerationStub(channel).Generate(request, timeout=TIMEOUT_S)
        first = [next(stream) for _ in range(3)]
        stream.cancel()
    got = [t for m in first for t in m.token_ids]
    assert [m.offset for m in first] == [0, len(first[0].token_ids),
                                         len(first[0].token_ids) + len(first[1].token_ids)]
    with grpc.insecure_channel(other.address) as channel:
        stub = gpb_grpc.GenerationStub(channel)

        def resume(token: bytes, token_ids: list[int]) -> list[gpb.GenerateResponse]:
            resumed = gpb.GenerateRequest()
            resumed.CopyFrom(request)
            resumed.resume.token, resumed.resume.token_ids[:] = token, token_ids
            return list(stub.Generate(resumed, timeout=TIMEOUT_S))

        rest = resume(first[-1].resume_token, got)  # on another router: the rest
        assert rest[0].offset == len(got)
        assert got + [t for m in rest for t in m.token_ids] == expected.token_ids
        assert "".join(m.text for m in first + rest) == expected.text
        assert rest[-1].usage.completion_tokens == len(expected.token_ids)
        forged = [got[:-1] + [(got[-1] + 1) % 100], got[:-1], got]
        tokens = [first[-1].resume_token, first[-1].resume_token, first[0].resume_token]
        for token_ids, token in zip(forged, tokens, strict=True):
            with pytest.raises(grpc.RpcError) as caught:
                resume(token, token_ids)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "does not seal" in (caught.value.details() or "")
        changed = gpb.GenerateRequest()
        changed.CopyFrom(request)
        changed.sampling.seed = 1  # another request under the same token
        changed.resume.token, changed.resume.token_ids[:] = first[-1].resume_token, got
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(changed, timeout=TIMEOUT_S))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(id, data) of each server-sent event of ``lines``."""
    event_id, data = None, None
    for line in lines:
        if not line:
            if data is not None:
                yield event_id, data
            event_id, data = None, None
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]


def test_an_http_stream_resumes_on_the_other_router_with_last_event_id(
        cluster: Cluster, llm: LLM) -> None:
    import json

    import httpx2

    other = _router_b(cluster.with_router())
    assert cluster.router is not None
    body = {"model": "", "prompt": f"{PROMPTS[3]} over HTTP", "max_tokens": 40,
            "temperature": 0.75, "seed": 3, "presence_penalty": 0.5, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "logprobs": 0}
    (expected,) = llm.generate([body["prompt"]], SamplingParams(
        max_tokens=40, temperature=0.75, seed=3, presence_penalty=0.5, ignore_eos=True))
    text, ids, last_id = "", [], None
    tokens: list[str] = []  # the logprobs' token strings and text offsets, both streams
    offsets: list[int] = []

    def logprobs(choice: dict) -> None:
        if choice["logprobs"] is not None:
            tokens.extend(choice["logprobs"]["tokens"])
            offsets.extend(choice["logprobs"]["text_offset"])

    url = f"http://{cluster.router.ready['http_address']}/v1/completions"
    with httpx2.Client(timeout=TIMEOUT_S) as http:
        with http.stream("POST", url, json=body) as response:  # 3 events, then gone
            for event_id, data in _sse(response.iter_lines()):
                choice = json.loads(data)["choices"][0]
                text, ids, last_id = text + choice["text"], ids + choice["token_ids"], event_id
                logprobs(choice)
                if len(ids) >= 3:
                    break
        assert last_id is not None and last_id.startswith(f"{len(ids)}.")
        received = list(ids)  # 3 or more (a client that fell behind gets several at once)
        resumed = {**body, "resume_token_ids": received}
        url = f"http://{other.ready['http_address']}/v1/completions"
        with http.stream("POST", url, json=resumed,
                         headers={"Last-Event-ID": last_id}) as response:
            assert response.status_code == 200
            for _event_id, data in _sse(response.iter_lines()):
                if data == "[DONE]":
                    break
                choice = json.loads(data)["choices"][0]
                text, ids = text + choice["text"], ids + choice["token_ids"]
                logprobs(choice)
        assert ids == expected.token_ids and text == expected.text
        # the resumed stream's text offsets go on after what the client had
        assert len(offsets) == len(ids) and offsets == [
            sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        forged = http.post(url, json={**resumed, "resume_token_ids": [
            *received[:-1], received[-1] - 1 if received[-1] else 1]}, headers={"Last-Event-ID": last_id})
        assert forged.status_code == 400 and "does not seal" in forged.text
        mismatched = http.post(url, json={**resumed, "resume_token_ids": received[:-1]},
                               headers={"Last-Event-ID": last_id})
        assert mismatched.status_code == 400 and "resume_token_ids" in mismatched.text
