"""A rolling restart under steady load: ``pdserve up`` (``LocalLauncher``, the library the
command runs) with two routers, two prefill and two decode workers; an SDK client given
both routers keeps 8 streams going while ``rolling_restart`` (what SIGHUP to ``pdserve up``
runs) replaces every process one at a time. At least 200 requests, none failed, every
one's tokens those of ``engine.LLM``; then the whole cluster's leak check."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.internal.v1 import worker_pb2_grpc as wpb_grpc
from deploy.local import LocalLauncher
from deploy.spec import ClusterSpec
from engine import LLM, SamplingParams
from pdserve import AsyncClient
from tests.auth import with_token
from tests.factories import PROMPTS
from tests.leaks import assert_cluster_idle

pytestmark = pytest.mark.timeout(420)

MIN_REQUESTS = 200
CONCURRENCY = 8
PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.75, seed=5, ignore_eos=True)]
PROMPT_SET = [f"{PROMPTS[i % 4]} #{i}" for i in range(12)]


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Iterator[LocalLauncher]:
    spec = ClusterSpec(model_dir=llama_dir, num_prefill=2, num_decode=2, num_routers=2,
                       port=0, http_port=None, num_kv_blocks=256, drain_s=5.0,
                       router_args=("--debug-port", "0"),
                       log_dir=tmp_path_factory.mktemp("rolling"))
    with LocalLauncher(spec) as launcher:
        yield launcher


def test_a_rolling_restart_of_every_process_fails_no_request(up: LocalLauncher,
                                                              llama_dir: Path) -> None:
    with LLM(llama_dir) as llm:
        expected = {(p, i): list(r.token_ids) for i, params in enumerate(PARAMS)
                    for p, r in zip(PROMPT_SET, llm.generate(PROMPT_SET, params), strict=True)}
    pids_before = up.pids()
    done = threading.Event()
    restart_error: list[BaseException] = []

    def restart() -> None:
        try:
            up.rolling_restart(settle_s=1.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            restart_error.append(exc)
        finally:
            done.set()

    results: list[tuple[str, int, list[int]]] = []
    failures: list[str] = []

    async def stream_loop(client: AsyncClient, worker: int) -> None:
        n = worker
        while not (done.is_set() and len(results) + len(failures) >= MIN_REQUESTS):
            prompt, which = PROMPT_SET[n % len(PROMPT_SET)], n % len(PARAMS)
            p = PARAMS[which]
            n += CONCURRENCY
            try:
                result = await client.complete(prompt, max_tokens=p.max_tokens,
                                               temperature=p.temperature, seed=p.seed,
                                               ignore_eos=True, timeout=120.0)
            except Exception as exc:  # noqa: BLE001 - counted, the loop goes on
                failures.append(f"{prompt!r}: {exc}")
                continue
            results.append((prompt, which, list(result.token_ids)))

    async def load() -> None:
        async with AsyncClient(up.router_addresses) as client:
            restarter = threading.Thread(target=restart, name="rolling-restart")
            restarter.start()
            try:
                await asyncio.gather(*(stream_loop(client, w) for w in range(CONCURRENCY)))
            finally:
                await asyncio.to_thread(restarter.join, 300)

    asyncio.run(load())
    assert not restart_error, restart_error
    assert failures == [], failures[:5]
    assert len(results) >= MIN_REQUESTS
    wrong = [(p, w) for p, w, tokens in results if tokens != expected[(p, w)]]
    assert wrong == [], wrong[:5]
    pids_after = up.pids()
    for name in [*up.spec.router_names, *up.spec.worker_names]:  # every one replaced
        assert pids_after[name] != pids_before[name], name
    stubs = []
    for child in up.workers:
        channel = with_token(grpc.insecure_channel(child.address), up.cluster_token)
        stubs.append(wpb_grpc.PrefillWorkerStub(channel) if child.name.startswith("prefill")
                     else wpb_grpc.DecodeWorkerStub(channel))
    assert up.redis_url is not None
    assert_cluster_idle(stubs, [str(r.ready["debug_address"]) for r in up.routers
                                if r.ready is not None],
                        up.redis_url, [w.name for w in up.workers], timeout_s=20.0)
