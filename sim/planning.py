"""The planner on the simulator's virtual clock: every ``interval_s`` the real
``planner.policy.Planner`` gets one window's observation of the simulated cluster and its
role changes are applied to the workers at once (what they hold of the old role goes on,
as a live ``SetRole`` does). With ``PlannerConfig.max_workers`` its scale steps are
applied too, as ``pdserve up --ray`` applies them: an added worker of the step's role
serves ``startup_s`` later; a removed one takes no new work (its role becomes ``RETIRED``)
and finishes what it holds in place (the real drain moves a decode worker's streams; here
they end where they are).

The observation is what the real planner reads from the cluster: arrivals per second and
mean prompt and output lengths of the window, each worker's held requests and the mean
queue wait of the prompts it started in the window, the window's mean inter-token latency
and mean TTFT.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.capacity import CapacityModel, Traffic
from planner.policy import Observation, Planner, PlannerConfig, RoleChange, WorkerState
from planner.scaling import ADD, ScaleChange
from sim.events import EventQueue
from sim.profile import Profile
from sim.state import SimRequest
from sim.worker import SimWorker

RETIRED = "retired"  # a removed worker's role: it takes no new work


@dataclass(frozen=True)
class PlannerSettings:
    """The planner of a simulated cluster: its config, how often it decides and over how
    long a window it looks."""

    config: PlannerConfig
    interval_s: float = 5.0
    window_s: float = 20.0
    startup_s: float = 0.0  # an added worker serves this long after the scale step

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0 or self.startup_s < 0:
            raise ValueError("the planner's interval and window must be positive, startup_s "
                             "not negative")


class SimPlanner:
    """Drives ``Planner`` over a run (``start`` once, before ``events.run``)."""

    def __init__(self, settings: PlannerSettings, profile: Profile, tp: int,
                 max_num_batched_tokens: int, workers: list[SimWorker],
                 requests: Sequence[SimRequest], events: EventQueue,
                 running: Callable[[], bool],
                 spawn: Callable[[str], SimWorker] | None = None) -> None:
        model = CapacityModel(profile.step(tp), max_num_batched_tokens=max_num_batched_tokens,
                              block_size=profile.model.block_size,
                              handoff_s=profile.handoff_overhead_s + profile.transfer_latency_s)
        self.planner = Planner(settings.config, model, clock=events.clock)
        self.settings = settings
        self._workers = workers
        self._requests = sorted(requests, key=lambda r: r.arrival_s)
        self._arrivals = [r.arrival_s for r in self._requests]
        self._first_open = 0  # every request before it ended before the last window
        self._events = events
        self._running = running  # whether requests are still to come or in flight
        self._spawn = spawn  # a new worker of a role, serving from now on
        self.size_changes: list[tuple[float, int]] = [(events.now, len(serving(workers)))]

    @property
    def changes(self) -> list[RoleChange]:
        return [d for d in self.planner.decisions if isinstance(d, RoleChange)]

    @property
    def scale_steps(self) -> list[ScaleChange]:
        return [d for d in self.planner.decisions if isinstance(d, ScaleChange)]

    def start(self) -> None:
        if self._requests:
            self._events.at(self._requests[0].arrival_s + self.settings.interval_s, self._tick)

    def _tick(self) -> None:
        for change in self.planner.decide(self.observe()):
            if isinstance(change, RoleChange):
                worker = self._by_id(change.worker_id)
                worker.role = change.to_role
                worker.beat_now()  # as a real worker's role change sends one at once
            elif change.action == ADD:
                self._events.after(self.settings.startup_s, self._add, change.role)
            else:
                self._by_id(change.worker_id or "").role = RETIRED
                self._sized()
        if self._running():
            self._events.after(self.settings.interval_s, self._tick)

    def _by_id(self, worker_id: str) -> SimWorker:
        return next(w for w in self._workers if w.worker_id == worker_id)

    def _add(self, role: str) -> None:
        assert self._spawn is not None, "scale steps need a spawn callback"
        self._spawn(role)
        self._sized()

    def _sized(self) -> None:
        self.size_changes.append((self._events.now, len(serving(self._workers))))

    def worker_seconds(self, start_s: float, end_s: float) -> float:
        """Workers serving × seconds, between ``start_s`` and ``end_s``."""
        points = [*self.size_changes, (end_s, 0)]
        return sum(n * max(0.0, min(b, end_s) - max(a, start_s))
                   for (a, n), (b, _) in zip(points, points[1:], strict=False))

    def observe(self) -> Observation:
        """The window ending now."""
        now = self._events.now
        since = now - self.settings.window_s
        requests, end = self._requests, bisect.bisect_right(self._arrivals, now)
        arrived = requests[bisect.bisect_right(self._arrivals, since):end]
        traffic = Traffic(len(arrived) / self.settings.window_s,
                          _mean([r.prompt_len for r in arrived]),
                          _mean([r.max_tokens for r in arrived]))
        workers = tuple(WorkerState(w.worker_id, w.role, _held(w), _mean([
            wait for _, wait in w.queue_waits[
                bisect.bisect_right(w.queue_waits, since, key=lambda q: q[0]):]]))
            for w in serving(self._workers))
        gaps: list[float] = []
        ttfts: list[float] = []
        # windows only move on: a request that ended before this one did before the next
        while self._first_open < end and _ended_before(requests[self._first_open], since):
            self._first_open += 1
        for r in requests[self._first_open:end]:
            if _ended_before(r, since):
                continue
            if r.first_token_s is not None and since < r.first_token_s <= now:
                ttfts.append(r.first_token_s - r.arrival_s)
            times, i = r.token_times_s, len(r.token_times_s) - 1
            while i >= 1 and times[i] > since:  # the window's gaps, from the end
                gaps.append(times[i] - times[i - 1])
                i -= 1
        return Observation(workers, traffic, itl_s=_mean(gaps) if gaps else None,
                           ttft_s=_mean(ttfts) if ttfts else None)


def _ended_before(request: SimRequest, since: float) -> bool:
    return request.finished_s is not None and request.finished_s <= since or bool(request.error)


def serving(workers: Sequence[SimWorker]) -> list[SimWorker]:
    """The workers that serve a role (not killed, not retired)."""
    return [w for w in workers if not w.dead and w.role != RETIRED]


def _held(worker: SimWorker) -> int:
    scheduler = worker.scheduler
    return len(scheduler.requests) + len(scheduler.reserved)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
