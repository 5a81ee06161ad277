"""A simulated cluster: ``SimSpec`` says what to run, ``simulate`` runs a workload on it.

    spec = SimSpec(num_prefill=2, num_decode=2)
    result = simulate(profile, spec, requests)   # requests: list[SimRequest]
    result.requests[0].first_token_s, result.check()

``num_routers`` routers (``sim.router``; requests in turn, sharing their loads and KV
index) in front of ``num_prefill`` prefill and ``num_decode`` decode
workers (``sim.worker``) of the profile's step models at ``prefill_tp`` / ``decode_tp``;
``handoff`` and ``admission`` are the router's own config dataclasses, so a simulated
flag means what the real one does. Everything is deterministic: the same profile, spec
and requests give the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.scheduler import StepUpdate
from planner.policy import RoleChange
from planner.scaling import ScaleChange
from router.config import AdmissionConfig, HandoffConfig
from sim.events import EventQueue
from sim.planning import PlannerSettings, SimPlanner
from sim.profile import Profile
from sim.router import SimRouter
from sim.state import SharedView, SimRequest
from sim.worker import SimWorker

DEFAULT_MAX_NUM_SEQS = SchedulerConfig.max_num_seqs  # the workers' defaults
DEFAULT_MAX_NUM_BATCHED_TOKENS = SchedulerConfig.max_num_batched_tokens
KV_EVENT_INTERVAL_S = 0.02  # the workers' publisher interval (worker.kv_events)


@dataclass(frozen=True)
class SimSpec:
    """The simulated cluster's shape and the router's configuration."""

    num_prefill: int = 1
    num_decode: int = 1
    num_routers: int = 1  # requests go to them in turn, as the SDK's calls do
    prefill_tp: int = 1
    decode_tp: int = 1
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    timeout_s: float = 600.0  # each request's deadline (the router's default)
    # faults: (worker id, virtual seconds): that worker dies then ("prefill-0", "decode-1")
    kills: tuple[tuple[str, float], ...] = ()
    kv_event_interval_s: float = KV_EVENT_INTERVAL_S
    planner: PlannerSettings | None = None  # the planner switches roles while it runs

    def __post_init__(self) -> None:
        SchedulerConfig(max_num_seqs=self.max_num_seqs,  # ConfigError (a ValueError) if wrong
                        max_num_batched_tokens=self.max_num_batched_tokens)
        if self.num_decode < 1:
            raise ValueError(f"a cluster needs at least one decode worker, got {self.num_decode}")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        names = {f"prefill-{i}" for i in range(self.num_prefill)} | {
            f"decode-{i}" for i in range(self.num_decode)}
        for worker_id, at_s in self.kills:
            if worker_id not in names or at_s < 0:
                raise ValueError(f"cannot kill {worker_id!r} at {at_s}s: workers are "
                                 f"{', '.join(sorted(names))}, times >= 0")
        if self.num_prefill == 0 and self.handoff.local_prefill == "never":
            raise ValueError("no prefill worker and local_prefill 'never': nothing can "
                             "prefill (use local_prefill 'always' or 'fallback')")
        if self.planner is not None:
            if self.prefill_tp != self.decode_tp:
                raise ValueError("the planner switches roles between workers of one TP size: "
                                 f"prefill_tp {self.prefill_tp} != decode_tp {self.decode_tp}")
            if self.planner.config.min_prefill == 0 and self.handoff.local_prefill == "never":
                raise ValueError("a planner that may leave no prefill worker (min_prefill 0) "
                                 "needs local_prefill 'fallback' or 'always'")


@dataclass
class SimResult:
    """What a run did: every request's fate, the workers, the virtual duration."""

    requests: list[SimRequest]
    workers: list[SimWorker]
    routers: list[SimRouter]
    duration_s: float  # first arrival to the last response (or the last event, if none)
    num_events: int
    role_changes: list[RoleChange] = field(default_factory=list)  # the planner's, in order
    scale_steps: list[ScaleChange] = field(default_factory=list)  # likewise
    worker_seconds: float = 0.0  # workers serving x seconds, first arrival to the end

    def check(self) -> None:
        """Conservation (``AssertionError`` naming what broke): every request ended once
        (a token stream or an error, never both), every worker is idle with its blocks back
        in the pool (free or cached), and the router holds nothing."""
        for r in self.requests:
            assert r.done, f"{r.request_id} never ended"
            assert not (r.error and r.finished_s is not None), f"{r.request_id} ended twice"
            if not r.error:  # a migrated stream too: every token once, in order
                assert len(r.token_times_s) == r.max_tokens, (
                    f"{r.request_id}: {len(r.token_times_s)} of {r.max_tokens} tokens")
                assert r.token_times_s == sorted(r.token_times_s), f"{r.request_id}: out of order"
        for w in self.workers:
            if w.dead:
                continue  # a killed worker's memory went with it
            usage = w.blocks.usage()
            assert w.idle(), f"{w.worker_id} is not idle: {usage}"
            assert usage.free + usage.cached == usage.total, f"{w.worker_id}: {usage}"
            w.blocks.check_integrity()
        for router in self.routers:
            assert not router.attempts and not router.queue and router.unfinished == 0
            assert router.admission.inflight == 0 and router.admission.queued_tokens == 0
        shared = self.routers[0].shared
        assert shared.unfinished == 0
        # any(): a count below zero (given back twice) fails too
        assert not any(shared.inflight.values()) and not any(shared.queued_tokens.values()), (
            shared.inflight, shared.queued_tokens)


Progress = Callable[[float, int, int], None]  # (virtual seconds, requests ended, requests)


def simulate(profile: Profile, spec: SimSpec, requests: Sequence[SimRequest], *,
             progress: Progress | None = None) -> SimResult:
    """Runs ``requests`` (each arriving at its ``arrival_s``) on the cluster of ``spec``;
    ``progress``, if given, hears how far the run is about every ten seconds of wall time."""
    events = EventQueue()
    workers: list[SimWorker] = []
    shared: SharedView | None = None

    def on_outputs(worker: SimWorker, updates: list[StepUpdate]) -> None:
        assert shared is not None
        shared.on_outputs(worker, updates)

    def new_worker(worker_id: str, role: str, tp: int) -> SimWorker:
        return SimWorker(worker_id, role, profile.step(tp), block_size=profile.model.block_size,
                         max_model_len=profile.model.max_model_len,
                         max_num_seqs=spec.max_num_seqs,
                         max_num_batched_tokens=spec.max_num_batched_tokens,
                         events=events, on_outputs=on_outputs)

    for role, count, tp in (("prefill", spec.num_prefill, spec.prefill_tp),
                            ("decode", spec.num_decode, spec.decode_tp)):
        workers += [new_worker(f"{role}-{i}", role, tp) for i in range(count)]
    shared = SharedView(events, workers, spec.handoff.prefill_routing, spec.kv_event_interval_s)
    routers = [SimRouter(events, profile, workers, shared, handoff=spec.handoff,
                         admission=spec.admission, timeout_s=spec.timeout_s)
               for _ in range(spec.num_routers)]
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    for i, request in enumerate(ordered):
        events.at(request.arrival_s, routers[i % len(routers)].submit, request)
    for worker_id, at_s in spec.kills:
        events.at(at_s, shared.kill, worker_id)

    def spawn(role: str) -> SimWorker:  # a scale step's new worker
        worker = new_worker(f"{role}-{len(workers)}", role, spec.decode_tp)
        workers.append(worker)  # the shared view's list
        assert shared is not None
        shared.add_worker(worker)
        for router in routers:
            router.add_worker(worker)
        return worker

    planner = None
    if spec.planner is not None:
        last = ordered[-1].arrival_s if ordered else 0.0
        planner = SimPlanner(spec.planner, profile, spec.decode_tp, spec.max_num_batched_tokens,
                             workers, ordered, events, lambda: events.now < last
                             or any(r.unfinished for r in routers), spawn)
        planner.start()
    events.run(progress=None if progress is None else lambda: progress(
        events.now, sum(r.done for r in ordered), len(ordered)))
    start = ordered[0].arrival_s if ordered else 0.0
    # the run ends with its last response, as vllm bench serve's duration does (events
    # after it: a planner tick, a KV event read, a retry timer)
    end = shared.last_end_s if shared.last_end_s is not None else events.now
    worker_seconds = (planner.worker_seconds(start, end) if planner is not None
                      else len(workers) * (end - start))
    return SimResult(list(requests), workers, routers, end - start, events.num_events,
                     planner.changes if planner is not None else [],
                     planner.scale_steps if planner is not None else [], worker_seconds)
