"""The planner through real processes: Redis, one prefill and one decode worker, a router
with ``--local-prefill fallback``, and ``pdserve planner`` processes given a profile whose
prefill is slow enough that, at the load the test drives, one prefill worker is
predicted to be near saturation while both workers prefilling locally are not.

- under that load the leading planner switches the prefill worker to decode (its reason
  in its log, ``pdserve:planner_decisions_total``), the router goes on serving with the
  decode workers prefilling, no request fails, sampled outputs equal ``engine.LLM``'s, and
  the planner then holds the split (its dwell time and the model agree);
- two planners: one leads, the other waits; the leader SIGKILLed, the other leads within
  the lock's TTL (and a planner's SIGTERM resigns the lock at once).

Every test ends with the cluster's leak check; the roles are set back after each.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.election import Election
from cluster.registry import Registry
from cluster.worker_control import set_role
from engine import LLM, SamplingParams
from pdserve import Client
from tests.e2e.cluster import Cluster, scrape_metrics
from tests.factories import PROMPTS
from tests.processes import Proc, spawn, wait_until
from tests.sim.profiles import write_slow_prefill_profile

pytestmark = pytest.mark.timeout(300)

CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1,
           "router_args": ("--local-prefill", "fallback")}
LOCK_TTL_S = 2.0
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_slow_prefill_profile(tmp_path_factory.mktemp("planner") / "profile.json")


def _planner(cluster: Cluster, profile: Path, name: str, *extra: str) -> Proc:
    return spawn(name, ["planner", "--redis-url", cluster.redis.url, "--profile", str(profile),
                        "--ttft-slo-ms", "450", "--tpot-slo-ms", "1000", "--interval", "0.5",
                        "--window", "3", "--dwell", "60", "--lock-ttl", str(LOCK_TTL_S),
                        "--planner-id", name, *extra], cluster.tmp).wait_ready()


def _planner_metric(planner: Proc, name: str) -> float:
    return scrape_metrics(planner.ready["metrics_address"]).get(name, 0.0)


def _roles(cluster: Cluster) -> dict[str, str]:
    with Registry(cluster.redis.url) as registry:
        return {w.worker_id: w.role for w in registry.list_workers()}


@pytest.fixture
def planners(cluster: Cluster) -> Iterator[list[Proc]]:
    """The planners a test starts; stopped, and the roles set back, afterwards."""
    started: list[Proc] = []
    yield started
    for planner in started:
        planner.stop()
    asyncio.run(set_role(cluster.prefill[0].address, "prefill"))
    wait_until(lambda: _roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode"}, 10,
               "the roles set back")
    cluster.wait_serving()


@contextlib.contextmanager
def _load(cluster: Cluster) -> Iterator[tuple[dict[str, list[int]], list[BaseException]]]:
    """Two clients sending unique greedy prompts (the prefix cache hides nothing) while the
    block runs: the prompts served with their tokens, and the errors."""
    counter = itertools.count()
    done: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def load(client: Client) -> None:
        while not stop.is_set():
            prompt = f"{PROMPTS[0]} request {next(counter)} of the planner test"
            try:
                done[prompt] = list(client.complete(prompt, max_tokens=MAX_TOKENS,
                                                    temperature=0.0, timeout=60).token_ids)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
            time.sleep(0.25)

    with Client(cluster.address) as client:
        threads = [threading.Thread(target=load, args=(client,), daemon=True)
                   for _ in range(2)]
        for t in threads:
            t.start()
        try:
            yield done, errors
        finally:
            stop.set()
            for t in threads:
                t.join(60)


def test_the_planner_switches_a_role_under_load_and_nothing_fails(
        cluster: Cluster, llm: LLM, profile: Path, planners: list[Proc]) -> None:
    planners.append(_planner(cluster, profile, "planner-a"))
    with _load(cluster) as (done, errors):
        wait_until(lambda: _roles(cluster).get("prefill-0") == "decode" or bool(errors),
                   60, "the planner to switch prefill-0 to decode")
        served_before = len(done)
        wait_until(lambda: len(done) >= served_before + 6 or bool(errors), 60,
                   "requests served after the switch (prefilled on decode workers)")
    assert not errors, errors
    assert _planner_metric(planners[0], "pdserve:planner_decisions_total{action=switch,"
                                        "reason=to_decode}") == 1
    assert _planner_metric(planners[0], "pdserve:planner_leader{}") == 1
    log = planners[0].log_path.read_text()
    assert "switched prefill-0: prefill -> decode:" in log and "req/s" in log, log[-2000:]
    sample = sorted(done)[::max(1, len(done) // 12)]  # a dozen, across the run
    expected = llm.generate(sample, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for prompt, result in zip(sample, expected, strict=True):
        assert done[prompt] == result.token_ids, prompt
    time.sleep(1.5)  # it holds the new split: no second change
    assert _planner_metric(planners[0], "pdserve:planner_decisions_total{action=switch,"
                                        "reason=to_prefill}") == 0
    assert _roles(cluster)["prefill-0"] == "decode"


def test_a_second_planner_takes_over_within_the_lock_ttl(
        cluster: Cluster, profile: Path, planners: list[Proc]) -> None:
    planners.append(_planner(cluster, profile, "planner-a"))
    wait_until(lambda: _planner_metric(planners[0], "pdserve:planner_leader{}") == 1, 10,
               "planner-a to lead")
    planners.append(_planner(cluster, profile, "planner-b"))
    time.sleep(1.0)  # two of its ticks: it waits
    assert _planner_metric(planners[1], "pdserve:planner_leader{}") == 0
    planners[0].stop(sig=9)
    killed_at = time.monotonic()
    wait_until(lambda: _planner_metric(planners[1], "pdserve:planner_leader{}") == 1, 10,
               "planner-b to take over")
    assert time.monotonic() - killed_at <= LOCK_TTL_S + 1.5  # the TTL and one tick
    planners[1].stop()  # SIGTERM: it resigns, the lock is free at once
    assert Election(cluster.redis.url, name="planner", holder="test").leader() is None
    planners.append(_planner(cluster, profile, "planner-c"))
    wait_until(lambda: _planner_metric(planners[2], "pdserve:planner_leader{}") == 1, 2,
               "planner-c to lead at once")


def test_a_planner_capped_at_one_decode_worker_keeps_the_split_under_that_load(
        cluster: Cluster, profile: Path, planners: list[Proc]) -> None:
    """The load that makes the first test's planner switch prefill-0 to decode: with
    ``--max-decode 1`` no split it may choose has two decode workers, so it holds."""
    planners.append(_planner(cluster, profile, "planner-capped", "--max-decode", "1"))
    held = "pdserve:planner_decisions_total{action=hold,reason=gain}"
    with _load(cluster) as (done, errors):
        wait_until(lambda: _planner_metric(planners[0], held) >= 6 or bool(errors), 60,
                   "the capped planner to see the load for 6 ticks")
    assert not errors, errors
    assert _planner_metric(planners[0], "pdserve:planner_decisions_total{action=switch,"
                                        "reason=to_decode}") == 0
    assert _planner_metric(planners[0], "pdserve:planner_desired_workers{role=decode}") == 1
    assert _roles(cluster) == {"prefill-0": "prefill", "decode-0": "decode"} and done
