"""The simulator (``sim``): deterministic, built from the real router and scheduler code,
conserving requests and blocks, and moving as the real cluster's levers say it should."""

from __future__ import annotations

import gc
import random
from dataclasses import replace
from typing import Any

import pytest

import engine.core.scheduler
import engine.kvcache.block_manager
import router.admission
import router.kv_index
import router.policy
from loadtest.workloads import Request
from router.config import AdmissionConfig, HandoffConfig
from sim import router as sim_router
from sim import runs as sim_runs
from sim import state as sim_state
from sim import worker as sim_worker
from sim.cluster import SimSpec, simulate
from sim.profile import from_json
from sim.state import SimRequest
from tests.sim.profiles import profile_json, small_profile


def requests(n: int = 60, *, rate: float = 20.0, prompt: int = 100, output: int = 12,
             shared: int = 0, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    prefix = tuple(rng.randrange(16, 30000) for _ in range(shared))
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        tail = tuple(rng.randrange(16, 30000) for _ in range(prompt - shared))
        out.append(SimRequest(f"r{i}", t, prefix + tail, output))
    return out


def fates(result: object) -> list[tuple[object, ...]]:
    return [(r.request_id, r.error, r.first_token_s, tuple(r.token_times_s), r.prefill_worker,
             r.decode_worker, r.cached_tokens) for r in result.requests]  # type: ignore[attr-defined]


def test_the_same_inputs_give_the_same_run() -> None:
    spec = SimSpec(num_prefill=2, num_decode=2)
    a = simulate(small_profile(), spec, requests(seed=3))
    b = simulate(small_profile(), spec, requests(seed=3))
    assert fates(a) == fates(b) and a.num_events == b.num_events
    c = simulate(small_profile(), spec, requests(seed=4))
    assert fates(a) != fates(c)


def test_a_runs_progress_reports_change_nothing_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sim.events

    spec = SimSpec(num_prefill=1, num_decode=2)
    quiet = simulate(small_profile(), spec, requests(seed=5))
    monkeypatch.setattr(sim.events, "PROGRESS_S", 0.0)  # a report at each look
    monkeypatch.setattr(sim.events, "PROGRESS_CHECK_EVENTS", 50)
    heard: list[tuple[float, int, int]] = []
    told = simulate(small_profile(), spec, requests(seed=5),
                    progress=lambda *report: heard.append(report))
    assert fates(told) == fates(quiet) and told.num_events == quiet.num_events
    assert len(heard) >= told.num_events // 50 - 1 >= 2
    assert all(total == 60 for _, _, total in heard)
    assert [t for t, _, _ in heard] == sorted(t for t, _, _ in heard)
    ended = [n for _, n, _ in heard]
    assert ended == sorted(ended) and ended[0] < 60 and ended[-1] <= 60


def test_the_simulator_runs_the_real_router_and_scheduler_code() -> None:
    result = simulate(small_profile(), SimSpec(num_prefill=1, num_decode=1), requests(5))
    worker = result.workers[0]
    # the engine's own classes, not copies
    assert type(worker.scheduler) is engine.core.scheduler.Scheduler
    assert type(worker.blocks) is engine.kvcache.block_manager.BlockManager
    assert type(result.routers[0].admission) is router.admission.Admission
    assert type(result.routers[0].kv_index) is router.kv_index.KVIndex
    # the router's decisions are the functions Placement calls
    assert sim_router.choose_prefill is router.policy.choose_prefill
    assert sim_router.short_tail is router.policy.short_tail


@pytest.mark.parametrize("spec", [
    SimSpec(num_prefill=2, num_decode=2),
    SimSpec(num_prefill=0, num_decode=2, handoff=HandoffConfig(local_prefill="always")),
    SimSpec(num_prefill=1, num_decode=1, handoff=HandoffConfig(prefill_routing="round-robin")),
    SimSpec(num_prefill=2, num_decode=1, handoff=HandoffConfig(prefill_routing="affinity")),
], ids=["disaggregated", "colocated", "round-robin", "affinity"])
def test_every_request_ends_once_and_every_block_comes_back(spec: SimSpec) -> None:
    result = simulate(small_profile(), spec, requests(80, rate=40.0, shared=48))
    result.check()  # conservation: see SimResult.check
    assert all(not r.error for r in result.requests)
    assert all(r.first_token_s is not None and r.first_token_s > r.arrival_s
               for r in result.requests)


def test_several_routers_each_admit_their_share() -> None:
    spec = SimSpec(num_prefill=2, num_decode=2, num_routers=3,
                   admission=AdmissionConfig(max_inflight=2, max_queued_tokens=None))
    result = simulate(small_profile(), spec, requests(30, rate=10_000.0))
    result.check()
    # each router's own budget of 2: more get in than one router alone would take
    single = simulate(small_profile(), replace(spec, num_routers=1),
                      requests(30, rate=10_000.0))
    served = [sum(not r.error for r in res.requests) for res in (result, single)]
    assert served[0] > served[1] >= 2


def test_kv_pressure_preempts_and_still_conserves() -> None:
    # 40 blocks of 16 tokens: a handful of 100-token prompts fill the decode worker
    profile = small_profile(num_kv_blocks=40)
    result = simulate(profile, SimSpec(num_prefill=1, num_decode=1),
                      requests(30, rate=200.0, output=40))
    result.check()
    assert sum(w.scheduler.stats.num_preemptions for w in result.workers) > 0
    assert all(not r.error for r in result.requests)


def test_admission_refuses_over_its_budget_as_the_router_does() -> None:
    spec = SimSpec(admission=AdmissionConfig(max_inflight=4, max_queued_tokens=None))
    result = simulate(small_profile(), spec, requests(20, rate=10_000.0))
    result.check()
    refused = [r for r in result.requests if r.error]
    assert refused and all(r.error.startswith("RESOURCE_EXHAUSTED") for r in refused)
    assert "--max-inflight 4" in refused[0].error


def test_a_queued_deadline_passes_as_deadline_exceeded() -> None:
    # room for one request at a time: 12 of 40 tokens each cannot all start within 50 ms
    # (each waits for its Reserve; conditional disaggregation off, whose local attempts
    # queue in the decode worker's engine instead)
    spec = SimSpec(timeout_s=0.05, handoff=HandoffConfig(local_prefill_max_tokens=0))
    result = simulate(small_profile(num_kv_blocks=16), spec, requests(12, rate=10_000.0,
                                                                      output=40))
    result.check()
    errors = [r.error for r in result.requests]
    assert "" in errors and any(e.startswith("DEADLINE_EXCEEDED") for e in errors)
    # a request no decode worker could ever hold fails at once, as the router's does
    small = simulate(small_profile(num_kv_blocks=8), spec, requests(1, output=40))
    assert small.requests[0].error.startswith("UNAVAILABLE: no decode worker can hold 9")


def test_kv_aware_routing_finds_the_shared_prefix_the_workers_cache() -> None:
    def reqs() -> list[SimRequest]:
        return requests(60, rate=20.0, prompt=160, shared=128)

    aware = simulate(small_profile(), SimSpec(num_prefill=4, num_decode=1), reqs())
    rr = simulate(small_profile(), SimSpec(num_prefill=4, num_decode=1, handoff=HandoffConfig(
        prefill_routing="round-robin")), reqs())
    cached = [sum(r.cached_tokens for r in res.requests) for res in (aware, rr)]
    assert cached[0] > cached[1]
    # the decode worker holds the prefix too: less KV travels than the whole prompts
    assert sum(r.kv_bytes for r in aware.requests) < sum(
        (r.prompt_len // 16 + 1) * 16 * 1024 for r in aware.requests)


def test_kv_aware_routing_counts_the_tokens_a_prefill_worker_lacks_as_queued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # as the real router (Placement.prefill_tokens): a queued prefill whose prefix the
    # worker holds adds only its uncached tokens to that worker's queue
    seen: list[tuple[dict[str, int], str]] = []

    def spy(*args: object, **kwargs: object) -> router.policy.PrefillChoice:
        choice = router.policy.choose_prefill(*args, **kwargs)  # type: ignore[arg-type]
        seen.append((dict(kwargs["queued_tokens"]), choice.order[0]))  # type: ignore[call-overload]
        return choice

    monkeypatch.setattr(sim_router, "choose_prefill", spy)
    prefix = tuple(range(100, 228))  # 8 blocks of 16
    reqs = [SimRequest("first", 0.0, prefix + tuple(range(1000, 1032)), 4),
            SimRequest("second", 1.0, prefix + tuple(range(2000, 2032)), 4),
            SimRequest("third", 1.0 + 1e-6, prefix + tuple(range(3000, 3032)), 4)]
    # (0: the decode worker holding the prefix does not take the short tails itself)
    spec = SimSpec(num_prefill=2, num_decode=1,
                   handoff=HandoffConfig(local_prefill_max_tokens=0))
    result = simulate(small_profile(), spec, reqs)
    result.check()
    assert [r.cached_tokens for r in result.requests] == [0, 128, 128]
    holder = seen[0][1]
    assert [chosen for _, chosen in seen] == [holder] * 3
    # when the third was placed, the second waited on the holder with 32 tokens to compute
    assert seen[2][0][holder] == 32


def test_a_busy_decode_worker_answers_between_its_steps() -> None:
    # a real decode worker's loop runs a Reserve and notices arrived KV between steps:
    # a stream joining a busy one gets its first token when a step of the other ends
    def run(*names: str) -> list[SimRequest]:
        reqs = {"long": SimRequest("long", 0.0, tuple(range(100, 164)), 300),
                "joins": SimRequest("joins", 0.2, tuple(range(1000, 1064)), 4)}
        result = simulate(small_profile(), SimSpec(num_prefill=1, num_decode=1),
                          [reqs[n] for n in names])
        result.check()
        return result.requests

    long, joins = run("long", "joins")
    assert joins.first_token_s is not None and long.finished_s > joins.first_token_s
    assert min(abs(t - joins.first_token_s) for t in long.token_times_s) < 1e-9
    # and it is later than on an idle decode worker, by less than two steps
    (alone,) = run("joins")
    wait = joins.first_token_s - alone.first_token_s
    assert 0 < wait < 2 * (0.002 + 2e-4 + 1e-7 * 2 * 400)


def test_a_prefill_goes_out_with_the_reserve_where_the_router_can_name_its_target(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # as router.lifecycle.placement: kv-aware, to a decode worker that holds none of the
    # prompt, the Prefill does not wait for the Reserve's reply, which a busy decode worker
    # sends after its step in flight; with affinity routing it does
    starts: dict[str, float] = {}
    prefill = sim_router.SimRouter._prefill

    def spy(self: sim_router.SimRouter, request: SimRequest, attempt: str) -> None:
        starts.setdefault(request.request_id, self.events.now)
        prefill(self, request, attempt)

    monkeypatch.setattr(sim_router.SimRouter, "_prefill", spy)
    waited = {}
    for routing in ("kv-aware", "affinity"):
        starts.clear()
        reqs = [SimRequest("long", 0.0, tuple(range(100, 164)), 300),
                SimRequest("joins", 0.2, tuple(range(1000, 1064)), 4)]
        spec = SimSpec(num_prefill=1, num_decode=1,
                       handoff=HandoffConfig(prefill_routing=routing))
        result = simulate(small_profile(), spec, reqs)
        result.check()
        waited[routing] = starts["joins"] - 0.2
    profile = small_profile()  # placed after the router's overhead, sent after the dispatch
    assert waited["kv-aware"] == pytest.approx(profile.router_overhead_s
                                               + profile.handoff_overhead_s / 2)
    assert waited["affinity"] > waited["kv-aware"]  # the decode worker was mid-step


def test_more_decode_workers_lower_the_time_per_output_token_under_load() -> None:
    def mean_tpot(num_decode: int) -> float:
        res = simulate(small_profile(), SimSpec(num_prefill=2, num_decode=num_decode),
                       requests(120, rate=60.0, output=40))
        res.check()
        spans = [(r.finished_s - r.first_token_s) / (len(r.token_times_s) - 1)
                 for r in res.requests]
        return sum(spans) / len(spans)

    assert mean_tpot(4) < mean_tpot(1)


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_a_killed_worker_s_requests_are_retried_or_migrated_and_none_fails(victim: str
                                                                            ) -> None:
    spec = SimSpec(num_prefill=2, num_decode=2, kills=((victim, 0.5),))
    # long prompts at a high rate: the prefill workers have a queue when one dies
    result = simulate(small_profile(num_kv_blocks=2048), spec,
                      requests(100, rate=150.0, prompt=600, output=40))
    result.check()  # every surviving token stream whole: max_tokens tokens, once each
    assert all(not r.error for r in result.requests)
    retried = [r for r in result.requests if r.num_attempts > 1]
    assert retried
    if victim.startswith("decode"):  # streams it was serving went on elsewhere
        assert any(r.migrations for r in retried)
    dead = next(w for w in result.workers if w.worker_id == victim)
    assert dead.dead
    # nothing arriving after the death was sent to it (its engine holds what it had then)
    served_after = {r.request_id for r in result.requests if r.arrival_s > 0.6}
    held = [*dead.scheduler.running, *dead.scheduler.waiting, *dead.scheduler.reserved.values()]
    assert served_after and not served_after & {r.request_id.split("#")[0] for r in held}


def test_a_prefill_worker_killed_while_its_kv_travels_has_the_attempt_retried() -> None:
    # a slow link: the KV of a 64-token prompt takes about 0.65 s to arrive
    slow = profile_json()
    slow["transfer"] = {"latency_s": 0.001, "bytes_per_s": 1e5}
    reqs = [SimRequest("r", 0.0, tuple(range(100, 164)), 4)]
    spec = SimSpec(num_prefill=1, num_decode=1, kills=(("prefill-0", 0.3),),
                   handoff=HandoffConfig(local_prefill="fallback"))
    result = simulate(from_json(slow), spec, reqs)
    result.check()  # it ended (before: never, and the KV index's feed ran forever)
    (r,) = result.requests
    # retried at once, prefilled on the decode worker (no prefill worker left)
    assert not r.error and r.num_attempts == 2 and 0.3 < r.first_token_s < 0.4


def test_a_prefill_worker_counts_an_attempt_until_its_kv_has_arrived(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # as the real router, whose Prefill call returns once the decode side has the KV: a
    # prefill worker's load counts the attempt while its KV travels, not only while it
    # computes (before, the sampled first token gave it back)
    seen: list[dict[str, int]] = []

    def spy(*args: object, **kwargs: object) -> router.policy.PrefillChoice:
        seen.append(dict(kwargs["loads"]))  # type: ignore[call-overload]
        return router.policy.choose_prefill(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_router, "choose_prefill", spy)
    slow = profile_json()
    slow["transfer"] = {"latency_s": 0.001, "bytes_per_s": 1e5}  # 64 tokens: ~0.65 s
    reqs = [SimRequest("a", 0.0, tuple(range(100, 164)), 4),
            SimRequest("b", 0.2, tuple(range(1000, 1064)), 4)]
    result = simulate(from_json(slow), SimSpec(num_prefill=2, num_decode=2), reqs)
    result.check()
    a = result.requests[0]
    assert a.first_token_s is not None and a.first_token_s > 0.6  # still travelling at 0.2
    assert seen[0] == {"prefill-0": 0, "prefill-1": 0}
    assert sorted(seen[1].values()) == [0, 1]  # b saw a's prefill worker holding it


def test_an_attempt_that_fails_before_its_first_token_is_a_retry_not_a_migration() -> None:
    # as the handoff's loop: a stream migrates when the attempt serving it had streamed;
    # the next attempt failing before its own first token (its prefill worker killed while
    # the KV travels) is a retry, counted against max_attempts, not the migration limit
    slow = profile_json()
    slow["transfer"] = {"latency_s": 0.001, "bytes_per_s": 1e5}
    spec = SimSpec(num_prefill=1, num_decode=2, kills=(("decode-0", 1.0), ("prefill-0", 1.3)),
                   handoff=HandoffConfig(local_prefill="fallback", migration_limit=1))
    result = simulate(from_json(slow), spec, [SimRequest("r", 0.0, tuple(range(100, 164)), 300)])
    result.check()
    (r,) = result.requests
    # migrated once (decode-0), retried once (prefill-0), then prefilled locally
    assert not r.error and r.migrations == 1 and r.num_attempts == 3
    # retries are bounded too: with none left to retry on, the request fails
    spec = replace(spec, handoff=HandoffConfig(local_prefill="never", migration_limit=1))
    (r,) = simulate(from_json(slow), spec,
                    [SimRequest("r", 0.0, tuple(range(100, 164)), 300)]).requests
    assert r.error == "UNAVAILABLE: no healthy prefill worker" and r.migrations == 1


def test_a_run_lasts_from_its_first_arrival_to_its_last_response() -> None:
    # as vllm bench serve's duration: not to the last event (here a kill long after)
    reqs = requests(20)
    result = simulate(small_profile(), SimSpec(num_prefill=1, num_decode=2,
                                               kills=(("decode-1", 100.0),)), reqs)
    result.check()
    last = max(r.finished_s for r in result.requests if r.finished_s is not None)
    assert result.duration_s == pytest.approx(last - reqs[0].arrival_s)


def test_the_kv_index_is_read_every_interval_once_whatever_the_arrivals(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the feed stops while nothing is in flight; arrivals just after it went idle must not
    # start a second chain of reads beside the first
    reads: list[float] = []
    feed = sim_state.SharedView._feed

    def counted(self: sim_state.SharedView) -> None:
        reads.append(self.events.now)
        feed(self)

    monkeypatch.setattr(sim_state.SharedView, "_feed", counted)
    # one at a time (each takes about 9 ms here), the next arriving before the read due
    reqs = [SimRequest(f"r{i}", 0.015 * i, tuple(range(100 + i, 164 + i)), 2)
            for i in range(10)]
    spec = SimSpec(num_prefill=1, num_decode=1, handoff=HandoffConfig(prefill_routing="kv-aware"))
    simulate(small_profile(), spec, reqs).check()
    gaps = [b - a for a, b in zip(reads, reads[1:], strict=False)]
    assert reads and min(gaps) >= 0.02 - 1e-9, gaps


def test_a_decode_worker_that_refused_a_reserve_gets_no_prefill_ahead_until_it_accepts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # router.lifecycle.ahead.AheadGate: decode-0 is full while its reported free blocks (a
    # heartbeat's, 3 s old) say it is not; after it refused d's Reserve, e's Reserve there
    # waits for its reply rather than sending e's Prefill with it
    calls: list[tuple[str, str, int | None, bool]] = []
    reserve = sim_worker.SimWorker.reserve

    def spy(self: sim_worker.SimWorker, request: Any, expected: int | None) -> int | None:
        out = reserve(self, request, expected)
        calls.append((request.request_id, self.worker_id, expected, out is not None))
        return out

    monkeypatch.setattr(sim_worker.SimWorker, "reserve", spy)
    reqs = [SimRequest("a", 0.0, tuple(range(100, 300)), 50),  # 15 of decode-0's 16 blocks
            SimRequest("c", 0.08, tuple(range(2000, 2100)), 4),
            SimRequest("d", 0.09, tuple(range(3000, 3100)), 4),
            SimRequest("e", 0.092, tuple(range(4000, 4100)), 4)]
    spec = SimSpec(num_prefill=1, num_decode=2, handoff=HandoffConfig(prefill_routing="kv-aware"))
    simulate(small_profile(num_kv_blocks=16), spec, reqs).check()
    assert ("d#0", "decode-0", 0, False) in calls  # sent ahead, refused
    first_of_e = next(c for c in calls if c[0] == "e#0")
    assert first_of_e == ("e#0", "decode-0", None, False)  # not ahead: the gate held it


def test_a_decode_worker_switched_to_prefill_never_prefills_its_own_reservation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the planner swaps the roles of the first request's decode worker and the prefill
    # worker between its Reserve and its Prefill: the worker holding the reservation is
    # then the only prefill worker, and one engine cannot hold the attempt twice
    place = sim_router.SimRouter._place
    swapped: list[str] = []

    def place_then_swap(self: sim_router.SimRouter, request: SimRequest) -> bool:
        placed = place(self, request)
        if placed and not swapped:
            self._worker(request.decode_worker or "").role = "prefill"
            self._worker("prefill-0").role = "decode"
            swapped.append(request.decode_worker or "")
        return placed

    monkeypatch.setattr(sim_router.SimRouter, "_place", place_then_swap)
    result = simulate(small_profile(), SimSpec(num_prefill=1, num_decode=2), requests(5))
    result.check()  # before: the prefill freed the reservation's blocks, and admitting failed
    assert swapped and all(not r.error for r in result.requests)
    assert result.requests[0].num_attempts == 2  # placed again, on a worker decoding now


def test_with_no_decode_worker_left_streams_fail_past_the_migration_limit() -> None:
    spec = SimSpec(num_prefill=1, num_decode=1, kills=(("decode-0", 0.3),))
    result = simulate(small_profile(), spec, requests(40, rate=40.0, output=40))
    result.check()
    errors = [r.error for r in result.requests if r.error]
    assert errors and all(e.startswith("UNAVAILABLE") for e in errors)
    with pytest.raises(ValueError, match="cannot kill 'decode-9'"):
        SimSpec(kills=(("decode-9", 1.0),))


def test_a_run_collects_garbage_less_often_and_leaves_the_collector_as_it_was() -> None:
    seen: list[tuple[int, ...]] = []
    spec = SimSpec(num_prefill=1, num_decode=1)
    loads = [Request(r.prompt_token_ids, r.max_tokens) for r in requests(5)]
    before = gc.get_threshold()

    def watched(*args: object, **kwargs: object) -> object:  # the collector as it sees it
        seen.append(gc.get_threshold())
        return simulate(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sim_runs, "simulate", watched)
        result = sim_runs.run(small_profile(), spec, loads, [0.01 * i for i in range(5)])
    assert result["completed"] == 5
    assert seen == [(100 * before[0], *before[1:])]
    assert gc.get_threshold() == before


def test_a_router_ranks_decode_workers_by_the_free_blocks_their_last_heartbeat_reported(
        ) -> None:
    # as a real router reads them from the registry: a worker's pool is seen as it was at
    # its last heartbeat (every 3 s), not as it is now
    from engine.core.request import Request as EngineRequest
    from engine.sampling_params import SamplingParams
    from sim.events import EventQueue
    from sim.worker import SimWorker

    events = EventQueue()
    worker = SimWorker("decode-0", "decode", small_profile().step(1), block_size=16,
                       max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=512,
                       events=events, on_outputs=lambda w, updates: None)
    free = worker.blocks.num_free_blocks
    assert worker.reported_free_blocks() == free
    events.at(1.0, worker.add, EngineRequest("a", list(range(16, 16 + 320)),
                                             SamplingParams(max_tokens=3500, ignore_eos=True)))
    seen: dict[float, tuple[int, int]] = {}
    for t in (2.9, 2.999, 3.1, 5.0, 6.2):
        events.at(t, lambda t=t: seen.update({t: (worker.reported_free_blocks(),
                                                  worker.blocks.num_free_blocks)}))
    events.run(until=6.5)
    assert seen[2.9][0] == free > seen[2.9][1]  # taken at 1 s, not yet reported
    assert seen[3.1][0] < free and seen[3.1][0] == seen[5.0][0]  # the 3 s heartbeat's:
    assert seen[3.1][0] == seen[2.999][1] != seen[3.1][1]  # the pool then, not at 3.1 s
    assert seen[5.0][1] < seen[5.0][0]  # its decoding took more since
    assert seen[6.2][0] < seen[5.0][0]  # the 6 s heartbeat's


def test_the_simulated_router_ranks_by_the_reported_free_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sim.worker import SimWorker

    reported: list[tuple[int, int]] = []  # (reported, live) per read
    ranked: list[int] = []  # the free blocks each candidate was ranked with
    report, rank = SimWorker.reported_free_blocks, sim_router.rank_decode

    def reading(worker: SimWorker) -> int:
        reported.append((report(worker), worker.blocks.num_free_blocks))
        return reported[-1][0]

    def ranking(candidates: list[object], *args: object) -> list[str]:
        ranked.extend(c.free_kv_blocks for c in candidates)  # type: ignore[attr-defined]
        return rank(candidates, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SimWorker, "reported_free_blocks", reading)
    monkeypatch.setattr(sim_router, "rank_decode", ranking)
    spec = SimSpec(num_prefill=0, num_decode=2,
                   handoff=HandoffConfig(local_prefill="always"))
    simulate(small_profile(), spec, requests(200, rate=40, output=200))
    assert ranked and ranked == [r for r, _ in reported][:len(ranked)]
    assert any(r != live for r, live in reported)  # the heartbeat's were not the pool's
