"""Soak (RELIABILITY row 37, marked ``slow``: ``pytest -m slow tests/router/test_soak.py``).

A cluster (2 prefill workers, 1 decode worker with 2 ranks, the router) serves mixed
load from several client threads for ``PDSERVE_SOAK_S`` seconds (default 60): greedy
requests whose tokens are checked against ``engine.LLM``, streams cancelled after a few
chunks, calls with deadlines too short to finish — while a prefill worker is SIGKILLed
and started again and Redis is restarted (losing everything). Afterwards every request
that was not hit by a fault has the right tokens, every failure has an expected status,
no worker holds a block, pin or transfer, and no process grew without bound.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve.client import Client, PdserveError
from tests.factories import PROMPTS
from tests.processes import Proc
from tests.router.cluster import Cluster, start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SOAK_S = float(os.environ.get("PDSERVE_SOAK_S", "60"))
NUM_CLIENTS = 6
MAX_TOKENS = 12
# statuses a request may end with when a fault or the client itself cut it short
EXPECTED_FAILURES = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                     grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(llama_dir, tmp_path_factory.mktemp("soak"), num_prefill=2,
                      num_decode=1, decode_tp=2)
    try:
        yield c
    finally:
        c.close()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Load:
    """Client threads issuing a random mix until ``stop``; tallies every outcome."""

    def __init__(self, address: str, expected: dict[str, list[int]]) -> None:
        self.address = address
        self.expected = expected
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.unexpected: list[str] = []
        self._lock = threading.Lock()

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        with Client(self.address) as client:
            while not self.stop.is_set():
                kind = rng.choice(("greedy", "greedy", "greedy", "cancel", "deadline"))
                prompt = rng.choice(list(self.expected))
                try:
                    getattr(self, f"_{kind}")(client, prompt, rng)
                    self._tally(kind)
                except PdserveError as exc:
                    if exc.code not in EXPECTED_FAILURES:
                        self.unexpected.append(f"{kind}: {exc}")
                    self._tally(f"{kind}:{exc.code.name}")

    def _greedy(self, client: Client, prompt: str, rng: random.Random) -> None:
        result = client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0,
                                 ignore_eos=True, timeout=60)
        if list(result.token_ids) != self.expected[prompt]:
            self.wrong.append(f"{prompt!r}: {list(result.token_ids)}")

    def _cancel(self, client: Client, prompt: str, rng: random.Random) -> None:
        stream = client.generate(prompt, max_tokens=200, ignore_eos=True, timeout=60)
        for i, _ in enumerate(stream):
            if i >= rng.randint(0, 5):
                break
        stream.close()

    def _deadline(self, client: Client, prompt: str, rng: random.Random) -> None:
        client.complete(prompt, max_tokens=400, ignore_eos=True,
                        timeout=rng.uniform(0.05, 0.5))

    def _tally(self, what: str) -> None:
        with self._lock:
            self.outcomes[what] += 1


def test_soak(cluster: Cluster, llama_dir: Path) -> None:
    prompts = [p for p in PROMPTS if len(p) > 3]
    with LLM(llama_dir) as llm:
        results = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                       ignore_eos=True))
    load = Load(cluster.address, {p: r.token_ids for p, r in zip(prompts, results,
                                                                 strict=True)})
    threads = [threading.Thread(target=load.run, args=(i,), daemon=True)
               for i in range(NUM_CLIENTS)]
    for thread in threads:
        thread.start()
    procs: list[Proc] = [p for p in [cluster.router, *cluster.workers()] if p is not None]
    try:
        time.sleep(SOAK_S / 3)
        rss_mid = {p.name: _rss_kib(p.proc.pid) for p in procs}
        _kill_and_restart_prefill(cluster)
        time.sleep(SOAK_S / 6)
        cluster.redis.restart()
        time.sleep(SOAK_S / 2)
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(90)
    print(f"soak outcomes over {SOAK_S:.0f}s: {dict(load.outcomes)}")
    assert not load.wrong, load.wrong[:5]
    assert not load.unexpected, load.unexpected[:5]
    assert load.outcomes["greedy"] >= 10, load.outcomes  # the cluster kept serving
    cluster.assert_no_leaks(timeout_s=30.0)
    for proc in procs:
        if proc.proc.poll() is None and proc.name in rss_mid:
            rss_end = _rss_kib(proc.proc.pid)
            assert rss_end < 1.5 * rss_mid[proc.name] + 64 * 1024, \
                (proc.name, rss_mid[proc.name], rss_end)


def _kill_and_restart_prefill(cluster: Cluster) -> None:
    victim = cluster.prefill.pop(1)
    victim.stop(sig=9)
    cluster.start_worker("prefill", 1).wait_ready()
