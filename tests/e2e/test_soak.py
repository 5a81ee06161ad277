"""Soak (RELIABILITY row 37, marked ``slow``: ``pytest -m slow tests/router/test_soak.py``).

A cluster (2 prefill workers, 2 decode workers with 2 ranks each, the router) serves
mixed load from several client threads for ``PDSERVE_SOAK_S`` seconds (default 60): greedy
requests whose tokens are checked against ``engine.LLM``, streams cancelled after a few
chunks, calls with deadlines too short to finish — while a prefill worker is SIGKILLed
and started again, a decode worker is hung (SIGSTOP) and resumed (SIGCONT), the other
decode worker is SIGKILLed and started again, and Redis is restarted (losing everything).
Afterwards every greedy request has the right tokens; a request fails only with the
status its kind allows (a too-short deadline: DEADLINE_EXCEEDED) or, if a fault touched
it (it was in flight while a worker was down or hung, or within the router's time to
notice), UNAVAILABLE or RESOURCE_EXHAUSTED — a Redis restart is no such fault; no worker
holds a block, pin or transfer, Redis lists exactly the live workers, and no process grew
without bound.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from cluster.registry import Registry, RegistryError
from engine import LLM, SamplingParams
from pdserve.client import Client, PdserveError
from tests.e2e.cluster import NUM_KV_BLOCKS, Cluster
from tests.factories import PROMPTS
from tests.processes import Proc, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SOAK_S = float(os.environ.get("PDSERVE_SOAK_S", "60"))
NUM_CLIENTS = 6
MAX_TOKENS = 12
# statuses a request may end with when a worker fault cut it short
FAULT_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
NOTICE_S = 15.0  # after a fault ends, requests may still meet it this long (detection, retries)
HANG_S = 5.0  # how long the decode worker stays SIGSTOPped


CLUSTER = {"num_prefill": 2, "num_decode": 2, "decode_tp": 2}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Load:
    """Client threads issuing a random mix until ``stop``; tallies every outcome, and
    keeps each failure with its time span to judge it once the fault windows are known."""

    def __init__(self, address: str, expected: dict[str, list[int]]) -> None:
        self.address = address
        self.expected = expected
        self.stop = threading.Event()
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[str] = []
        self.failures: list[tuple[str, grpc.StatusCode, float, float, str]] = []
        self._lock = threading.Lock()

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        with Client(self.address) as client:
            while not self.stop.is_set():
                kind = rng.choice(("greedy", "greedy", "greedy", "cancel", "deadline"))
                prompt = rng.choice(list(self.expected))
                start = time.monotonic()
                try:
                    getattr(self, f"_{kind}")(client, prompt, rng)
                    self._tally(kind)
                except PdserveError as exc:
                    with self._lock:
                        self.failures.append((kind, exc.code, start, time.monotonic(),
                                              exc.details))
                    self._tally(f"{kind}:{exc.code.name}")

    def unexpected(self, faults: list[tuple[float, float]]) -> list[str]:
        """Failures neither their kind nor a fault they met explains."""
        out = []
        for kind, code, start, end, details in self.failures:
            touched = any(start <= f_end + NOTICE_S and end >= f_start
                          for f_start, f_end in faults)
            allowed = {grpc.StatusCode.DEADLINE_EXCEEDED} if kind == "deadline" else set()
            if code not in allowed | (FAULT_FAILURES if touched else set()):
                out.append(f"{kind} {code.name} ({'touched' if touched else 'no fault'}, "
                           f"{end - start:.1f}s): {details}")
        return out

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
    faults: list[tuple[float, float]] = []  # (start, end) of each worker fault
    try:
        time.sleep(SOAK_S / 6)
        rss_mid = {p.name: _rss_kib(p.proc.pid) for p in procs}
        faults.append(_kill_and_restart(cluster, "prefill", 1))
        time.sleep(SOAK_S / 6)
        faults.append(_hang_and_resume(cluster.decode[0]))
        time.sleep(SOAK_S / 6)
        faults.append(_kill_and_restart(cluster, "decode", 1))
        time.sleep(SOAK_S / 6)
        cluster.redis.restart()  # not a fault: no request may fail of it
        time.sleep(SOAK_S / 3)
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(90)
    print(f"soak outcomes over {SOAK_S:.0f}s: {dict(load.outcomes)}")
    assert not load.wrong, load.wrong[:5]
    unexpected = load.unexpected(faults)
    assert not unexpected, unexpected[:5]
    assert load.outcomes["greedy"] >= 10, load.outcomes  # the cluster kept serving
    cluster.assert_no_leaks(timeout_s=30.0)
    with Registry(cluster.redis.url) as registry:  # Redis: one key per live worker
        wait_until(lambda: {r.worker_id for r in registry.list_workers()} ==
                   {w.name for w in cluster.workers()}, 30.0,
                   "Redis to list exactly the live workers", ignore=(RegistryError,))
    for proc in [p for p in [cluster.router, *cluster.workers()] if p is not None]:
        if proc in procs and proc.proc.poll() is None and proc.name in rss_mid:
            rss_end = _rss_kib(proc.proc.pid)
            assert rss_end < 1.5 * rss_mid[proc.name] + 64 * 1024, \
                (proc.name, rss_mid[proc.name], rss_end)


def _kill_and_restart(cluster: Cluster, role: str, index: int) -> tuple[float, float]:
    """SIGKILL worker ROLE-INDEX and start it again; the fault's (start, end)."""
    workers = cluster.prefill if role == "prefill" else cluster.decode
    victim = next(w for w in workers if w.name == f"{role}-{index}")
    workers.remove(victim)
    start = time.monotonic()
    victim.stop(sig=9)
    extra = ("--tensor-parallel-size", "2", "--num-kv-blocks", str(NUM_KV_BLOCKS)) \
        if role == "decode" else ()
    cluster.start_worker(role, index, *extra).wait_ready()
    return start, time.monotonic()


def _hang_and_resume(victim: Proc) -> tuple[float, float]:
    """SIGSTOP ``victim`` (its ranks keep running) for ``HANG_S``, then SIGCONT."""
    start = time.monotonic()
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(HANG_S)
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    return start, time.monotonic()
