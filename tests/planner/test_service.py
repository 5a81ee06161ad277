"""``planner.service``: a draining worker is left out; a round in which a registered
worker's ``/metrics`` did not answer decides nothing and stays out of the window (the
policy would read the worker as gone). The registry, the lock, the scrapes and the policy
are stand-ins: this is the service's own bookkeeping (the planner through real processes:
tests/e2e/test_planner.py)."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from planner import service
from planner.metrics import PlannerMetrics
from planner.policy import Observation
from tests.router.test_workers import make_record

RECORDS = [make_record("prefill-0", "prefill", "127.0.0.1:1", metrics_address="127.0.0.1:11"),
           make_record("decode-0", "decode", "127.0.0.1:2", metrics_address="127.0.0.1:12"),
           # leaving: neither capacity nor one to switch (nor scraped)
           make_record("decode-1", "decode", "127.0.0.1:3", metrics_address="127.0.0.1:13",
                       draining=True)]


class Registry:
    def list_workers(self) -> list[Any]:
        return RECORDS


class Election:
    def __init__(self, answers: list[bool] | None = None,
                 notes: dict[str, str] | None = None) -> None:
        self.answers = answers
        self.notes = notes if notes is not None else {}  # the lock's note, if shared

    def lead(self) -> bool:
        return self.answers.pop(0) if self.answers else True

    def leave_note(self, note: str) -> bool:
        self.notes["note"] = note
        return True

    def note(self) -> str | None:
        return self.notes.get("note")


class Policy:
    """Records what it was asked to decide on; decides nothing."""

    held, current, wanted = "", None, None

    def __init__(self, now: list[float] | None = None) -> None:
        self.seen: list[Observation] = []
        self.decisions: list[Any] = []
        self.now = now if now is not None else [0.0]
        self.last_change_at = -math.inf

    def clock(self) -> float:
        return self.now[0]

    def decide(self, obs: Observation) -> list[Any]:
        self.seen.append(obs)
        self.decisions.append(("held", len(self.seen)))  # as the policy's record grows
        return []


def test_an_unscraped_round_decides_nothing_and_stays_out_of_the_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    policy = Policy()
    planner = service.PlannerService(policy, Registry(), Election(),  # type: ignore[arg-type]
                                     PlannerMetrics(), window_s=10.0, clock=lambda: now[0])
    served: dict[str, float] = {}  # prompt tokens by worker: 100 more at each scrape
    failing: set[str] = set()

    def scrape(address: str) -> dict[str, float]:
        assert address != "127.0.0.1:13", "a draining worker was scraped"
        if address in failing:
            raise ValueError("a reply that does not parse")  # not only OSError
        served[address] = served.get(address, 0.0) + 100.0
        return {"vllm:prompt_tokens_total{}": served[address],
                "vllm:request_success_total{finished_reason=prefilled}": served[address] / 100}

    monkeypatch.setattr(service, "scrape", scrape)
    failing.add("127.0.0.1:12")  # the decode worker does not answer the first round
    assert planner.tick() == [] and not policy.seen
    failing.clear()
    for t in (1.0, 6.0):
        now[0] = t
        planner.tick()
    assert len(policy.seen) == 1  # the first complete round opened the window
    obs = policy.seen[0]
    assert sorted(w.worker_id for w in obs.workers) == ["decode-0", "prefill-0"]
    # counted from the first complete round (t = 1), not from nothing (5 prompts) nor from
    # the prefill worker's scrape in the round that failed (3): 1 prompt more at each
    # worker over 5 s
    assert obs.traffic.rate == pytest.approx(2 / 5.0)
    failing.add("127.0.0.1:11")  # the prefill worker stops answering: no decision
    now[0] = 7.0
    assert planner.tick() == [] and len(policy.seen) == 1


def test_a_change_is_made_only_while_the_lock_is_still_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock is renewed before acting: a round that outlasted it (slow scrapes, a
    pause) makes no change, which the new leader may be making already."""
    from planner.policy import RoleChange

    class Decides(Policy):
        def decide(self, obs: Observation) -> list[Any]:
            super().decide(obs)
            return [RoleChange(0.0, "decode-0", "decode", "prefill", "test", 0.1, 0.9)]

    switched: list[str] = []

    async def set_role(address: str, role: str, **kwargs: Any) -> None:
        switched.append(role)

    monkeypatch.setattr(service, "scrape", lambda address: {})
    monkeypatch.setattr(service, "set_role", set_role)
    now = [0.0]
    # rounds at 0 and 6 s lead; the second round's renewal before acting fails
    election = Election([True, True, False])
    planner = service.PlannerService(Decides(), Registry(), election,  # type: ignore[arg-type]
                                     PlannerMetrics(), window_s=10.0, clock=lambda: now[0])
    planner.tick()
    now[0] = 6.0
    assert planner.tick() == [] and switched == []
    now[0], election.answers = 7.0, None  # leading again: a fresh window first
    assert planner.tick() == [] and switched == []
    now[0] = 13.0
    assert len(planner.tick()) == 1 and switched == ["prefill"]


def test_a_round_scrapes_every_worker_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not one after another: a round's samples are of one moment, and a hung worker
    costs the round one timeout, not one per worker after it."""
    now = [0.0]
    policy = Policy()
    planner = service.PlannerService(policy, Registry(), Election(),  # type: ignore[arg-type]
                                     PlannerMetrics(), window_s=10.0, clock=lambda: now[0])
    together = threading.Barrier(2, timeout=5.0)  # passes only with both scrapes in flight

    def scrape(address: str) -> dict[str, float]:
        together.wait()
        return {}

    monkeypatch.setattr(service, "scrape", scrape)
    for now[0] in (0.0, 6.0):
        planner.tick()
    assert len(policy.seen) == 1 and not together.broken


def test_a_new_leader_wants_what_there_is_until_it_decides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An autoscaler reads the desired gauges where ``pdserve:planner_leader`` is 1: from
    the first round of a term (even one whose scrapes failed) they hold the workers there
    are, never the zeros they start at or a former term's figures."""
    def scrape(address: str) -> dict[str, float]:
        raise OSError("connection refused")  # no round completes

    monkeypatch.setattr(service, "scrape", scrape)
    metrics = PlannerMetrics()
    election = Election([True, False, True])
    planner = service.PlannerService(Policy(), Registry(), election,  # type: ignore[arg-type]
                                     metrics, window_s=10.0, clock=lambda: 0.0)

    def gauges() -> tuple[float | None, ...]:
        value = metrics.registry.get_sample_value
        return (value("pdserve:planner_leader"),
                *(value("pdserve:planner_desired_workers", {"role": r})
                  for r in ("prefill", "decode")))

    assert planner.tick() == [] and gauges() == (1.0, 1.0, 1.0)  # the draining one left out
    metrics.desired.labels("decode").set(5)  # what this term went on to want
    assert planner.tick() == [] and gauges()[0] == 0.0  # another planner leads meanwhile
    assert planner.tick() == [] and gauges() == (1.0, 1.0, 1.0)  # a new term starts afresh


def test_the_policys_record_of_its_decisions_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "scrape", lambda address: {})
    monkeypatch.setattr(service, "KEEP_DECISIONS", 3)
    now = [0.0]
    policy = Policy()
    planner = service.PlannerService(policy, Registry(), Election(),  # type: ignore[arg-type]
                                     PlannerMetrics(), window_s=2.0, clock=lambda: now[0])
    for t in range(10):
        now[0] = float(t)
        planner.tick()
    assert len(policy.seen) == 9 and policy.decisions == [("held", n) for n in (7, 8, 9)]


def test_a_new_leader_keeps_the_dwell_of_the_last_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader notes each change's time on the lock; a planner that takes over counts
    its dwell from there, on its own monotonic clock, and ignores a note not its own."""
    from planner.policy import RoleChange

    class Decides(Policy):
        def decide(self, obs: Observation) -> list[Any]:
            super().decide(obs)
            self.last_change_at = self.clock()
            return [RoleChange(0.0, "decode-0", "decode", "prefill", "test", 0.1, 0.9)]

    async def set_role(address: str, role: str, **kwargs: Any) -> None:
        pass

    monkeypatch.setattr(service, "scrape", lambda address: {})
    monkeypatch.setattr(service, "set_role", set_role)
    wall, notes = [1000.0], {}
    first = Decides([0.0])
    leader = service.PlannerService(first, Registry(), Election(notes=notes),  # type: ignore[arg-type]
                                    PlannerMetrics(), window_s=10.0,
                                    clock=lambda: first.now[0], wall=lambda: wall[0])
    leader.tick()
    first.now[0], wall[0] = 6.0, 1006.0
    assert len(leader.tick()) == 1  # a change at wall-clock 1006
    # another planner, whose monotonic clock reads 500, takes over 10 s later
    second = Policy([500.0])
    wall[0] = 1016.0
    follower = service.PlannerService(second, Registry(), Election(notes=notes),  # type: ignore[arg-type]
                                      PlannerMetrics(), window_s=10.0,
                                      clock=lambda: second.now[0], wall=lambda: wall[0])
    follower.tick()
    assert second.last_change_at == pytest.approx(490.0)
    third = Policy([0.0])
    notes["note"] = "not json"
    service.PlannerService(third, Registry(), Election(notes=notes),  # type: ignore[arg-type]
                           PlannerMetrics(), window_s=10.0, clock=lambda: 0.0).tick()
    assert third.last_change_at == -math.inf
