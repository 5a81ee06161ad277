"""The planner's decision, I/O-free on an injectable clock: given one window's
observation of the cluster, which worker (if any) should switch role now, and why.

    planner = Planner(PlannerConfig(ttft_slo_s=1.0, tpot_slo_s=0.05), model, clock)
    for change in planner.decide(observation):   # at most one RoleChange
        ...                                      # SetRole(change.worker_id, change.to_role)

For every split of the workers it can reach (at least ``min_prefill`` prefill and
``min_decode`` decode workers) it predicts the SLO attainment (``planner.capacity``) and
takes the best, but only when that beats the current split's prediction by ``min_gain``
(hysteresis) and no role changed within ``dwell_s`` (no flapping); then it moves one worker
a step towards it: the worker of the role that shrinks holding the least work. The
model is corrected by what was measured: the mean prefill queue wait of the window
implies an effective prefill rate (the one the planner uses when lower than the
model's: a planner blind to queue time keeps estimating TTFT from compute alone), and the
measured inter-token latency scales the decode costs. The same object runs in the real
cluster (``pdserve planner``) and in the simulator (``sim``).

With ``max_workers`` set it also sizes the cluster, one worker at a time within
``min_workers``..``max_workers`` (``planner.scaling``): it adds a worker when that is
predicted to gain more than switching roles can, and removes one that is not needed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.capacity import CapacityModel, Prediction, Traffic, effective_prefill_rate
from planner.scaling import ADD, REMOVE, ScaleChange, scale_choice, step_role

ROLES = ("prefill", "decode")
HOLDS = {"no_traffic": "nothing arrived in the window", "bounds": "the split is outside "
         "its roles' bounds and no switch brings it back", "gain": "no split is predicted better by min_gain",
         "dwell": "a role changed less than dwell_s ago",
         "scaling": "the last scale step's size is not observed yet"}


@dataclass(frozen=True)
class PlannerConfig:
    """The SLO the split is chosen for and the planner's restraint."""

    ttft_slo_s: float
    tpot_slo_s: float
    dwell_s: float = 30.0  # after a role change, none for this long
    min_gain: float = 0.05  # a split must be predicted this much better to move towards it
    min_prefill: int = 0  # 0: the decode workers may prefill (the router's local prefill)
    min_decode: int = 1
    # each role's most workers (None: no cap); a cluster grows to their sum at most
    max_prefill: int | None = None
    max_decode: int | None = None
    # the cluster's size bounds (``planner.scaling``); max_workers None: never add or remove
    min_workers: int | None = None  # default: min_prefill + min_decode
    max_workers: int | None = None
    scale_down_slack: float = 0.01  # a worker goes when one fewer loses no more than this
    # after a scale step, no other until the cluster is observed at its size, or this long
    scale_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("the TTFT and TPOT SLOs must be positive")
        if self.dwell_s < 0 or self.min_gain < 0:
            raise ValueError("dwell_s and min_gain must not be negative")
        if self.min_prefill < 0 or self.min_decode < 1:
            raise ValueError("min_prefill must be >= 0 and min_decode >= 1")
        for role, low, high in (("prefill", self.min_prefill, self.max_prefill),
                                ("decode", self.min_decode, self.max_decode)):
            if high is not None and high < low:
                raise ValueError(f"max_{role} ({high}) must be at least min_{role} ({low})")
        floor = self.min_prefill + self.min_decode
        if self.max_prefill is not None and self.max_decode is not None and (
                self.min_workers or floor) > self.max_prefill + self.max_decode:
            raise ValueError(f"min_workers ({self.min_workers or floor}) is more than "
                             f"max_prefill + max_decode ({self.max_prefill + self.max_decode})")
        if self.min_workers is not None and self.max_workers is None:
            raise ValueError("min_workers needs max_workers (the planner then sizes the "
                             "cluster)")
        if self.min_workers is not None and self.min_workers < floor:
            raise ValueError(f"min_workers must be at least min_prefill + min_decode ({floor})")
        if self.max_workers is not None and self.max_workers < (self.min_workers or floor):
            raise ValueError(f"max_workers ({self.max_workers}) must be at least min_workers "
                             f"({self.min_workers or floor})")
        if self.scale_down_slack < 0 or (self.max_workers is not None
                                         and self.scale_down_slack >= self.min_gain):
            raise ValueError("scale_down_slack must be >= 0 and below min_gain (hysteresis)")

    def size_bounds(self, num_workers: int) -> tuple[int, int]:
        """The sizes the cluster may take (``num_workers`` only, when it does not scale)."""
        if self.max_workers is None:
            return num_workers, num_workers
        high = self.max_workers
        if self.max_prefill is not None and self.max_decode is not None:
            high = min(high, self.max_prefill + self.max_decode)
        return self.min_workers or self.min_prefill + self.min_decode, high

    def prefill_counts(self, num_workers: int) -> range:
        """The prefill workers a split of ``num_workers`` may have within every role's
        bounds (empty: none may)."""
        low = self.min_prefill if self.max_decode is None else max(
            self.min_prefill, num_workers - self.max_decode)
        high = num_workers - self.min_decode
        if self.max_prefill is not None:
            high = min(high, self.max_prefill)
        return range(low, high + 1)


@dataclass(frozen=True)
class WorkerState:
    """One worker as the window saw it: its role, the requests it holds, and the mean
    queue wait of the prompts it started in the window (prefill: before the first chunk;
    0 when unknown)."""

    worker_id: str
    role: str
    held: int = 0
    queue_wait_s: float = 0.0


@dataclass(frozen=True)
class Observation:
    """One window of the cluster: its workers, its traffic and the measured decode step
    (mean inter-token latency; None when nothing was decoded)."""

    workers: tuple[WorkerState, ...]
    traffic: Traffic
    itl_s: float | None = None
    ttft_s: float | None = None  # the window's mean TTFT, for the reason only

    def of_role(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class RoleChange:
    """A decision: ``worker_id`` goes from ``from_role`` to ``to_role`` at ``t``."""

    t: float
    worker_id: str
    from_role: str
    to_role: str
    reason: str
    predicted_before: float
    predicted_after: float


Decision = RoleChange | ScaleChange


@dataclass
class Planner:
    """See the module doc. ``decisions`` keeps every change it made."""

    config: PlannerConfig
    model: CapacityModel
    clock: Callable[[], float] = time.monotonic
    decisions: list[Decision] = field(default_factory=list)
    last_change_at: float = -math.inf
    held: str = ""  # why the last decision moved nothing: HOLDS' keys ("" when it moved)
    desired: Prediction | None = None  # the split it wants at the last decision
    current: Prediction | None = None  # the split as it was at the last decision
    wanted: tuple[int, int] | None = None  # (prefill, decode) it wants: the gauges' figures
    pending: tuple[int, float] | None = None  # the last scale step's size, and when

    def predictions(self, obs: Observation, size: int | None = None) -> list[Prediction]:
        """Every reachable split of ``size`` workers (default: those observed), fewest
        prefill workers first."""
        n = len(obs.workers) if size is None else size
        prefill, decode = obs.of_role("prefill"), obs.of_role("decode")
        queueing = prefill or decode  # without prefill workers the decode ones prefill
        waits = [w.queue_wait_s for w in queueing]
        measured = effective_prefill_rate(obs.traffic, len(queueing), sum(waits) / len(waits)
                                          if waits else 0.0)
        rate = min(self.model.prefill_rate(obs.traffic.prompt_tokens), measured)
        scale = 1.0
        if obs.itl_s is not None and decode:
            # the current split's own prediction: a colocated one's includes its prefills
            predicted = self.model.inter_token_s(obs.traffic, len(prefill), len(decode))
            if math.isfinite(predicted) and predicted > 0:
                scale = min(4.0, max(0.5, obs.itl_s / predicted))
        c = self.config
        return [self.model.predict(obs.traffic, p, n - p, ttft_slo_s=c.ttft_slo_s,
                                   tpot_slo_s=c.tpot_slo_s, prefill_rate=rate,
                                   decode_scale=scale)
                for p in c.prefill_counts(n)]

    def decide(self, obs: Observation) -> list[Decision]:
        """At most one role change or scale step (empty: hold; ``held`` says why)."""
        now = self.clock()
        n, current_p = len(obs.workers), len(obs.of_role("prefill"))
        self.wanted = (current_p, n - current_p)
        if self.pending is not None and (self.pending[0] == n
                                         or now - self.pending[1] >= self.config.scale_timeout_s):
            self.pending = None  # the step is done (or given up on)
        if obs.traffic.rate <= 0:
            return self._idle(obs, now)
        options = self.predictions(obs)
        current = next((o for o in options if o.num_prefill == current_p), None)
        if current is None or not options:  # outside the bounds: back within them first
            return self._repair(obs, now)
        best = _best(options, current_p)
        self.desired, self.current = best, current
        self.wanted = (best.num_prefill, best.num_decode)
        if self.config.max_workers is not None:
            scaled = self._scale(obs, now, current, best)
            if scaled is not None:
                return scaled
        if best.attainment < current.attainment + self.config.min_gain:
            return self._hold("gain")
        if now - self.last_change_at < self.config.dwell_s:
            return self._hold("dwell")
        grow = "prefill" if best.num_prefill > current_p else "decode"
        shrink = "decode" if grow == "prefill" else "prefill"
        worker = _least_held(obs, shrink)
        step = next(o for o in options if o.num_prefill == current_p + (1 if grow == "prefill"
                                                                        else -1))
        return self._made(RoleChange(now, worker.worker_id, shrink, grow,
                                     _reason(obs, current, best, step), current.attainment,
                                     step.attainment), now)

    def _scale(self, obs: Observation, now: float, current: Prediction, best: Prediction
               ) -> list[Decision] | None:
        """A scale step (or a hold for its dwell), or None: no step is due (a role switch
        may be)."""
        n, p = len(obs.workers), current.num_prefill
        low, high = self.config.size_bounds(n)
        ups = [_best(options, p) for k in range(n + 1, high + 1)
               if (options := self.predictions(obs, k))]
        up = max(ups, key=lambda o: round(o.attainment, 9), default=None)  # smallest of equals
        downs = self.predictions(obs, n - 1) if n > low else []
        down = _best(downs, p) if downs else None
        choice = scale_choice(current, best, up, down, min_gain=self.config.min_gain,
                              slack=self.config.scale_down_slack)
        below = n < low and bool(ups)
        if below:  # below the minimum size: grow whatever the gain
            choice = (ADD, ups[0])
        if choice is None or not below and (
                best.attainment >= current.attainment + self.config.min_gain):
            # nothing to add or remove, or a switch comes first: it takes effect at once,
            # where a new worker takes minutes to load (and a step still in flight may
            # never land); the step is weighed again from the split it leaves
            return None
        action, target = choice
        role = step_role(action, p, target)
        delta = 1 if action == ADD else -1
        split = (p + delta, n - p) if role == "prefill" else (p, n - p + delta)
        # the gauges (and an autoscaler reading them) ask for this step, one worker at a
        # time, not for the far size the target has
        self.desired, self.wanted = target, split
        if self.pending is not None:
            return self._hold("scaling")  # the last step is not observed yet
        if now - self.last_change_at < self.config.dwell_s:
            return self._hold("dwell")
        step = next((o for o in self.predictions(obs, n + delta) if o.num_prefill == split[0]),
                    None)
        if step is None:  # one worker of that role would leave its bounds: switch first
            return None
        worker = None if action == ADD else _least_held(obs, role).worker_id
        self.pending = (n + delta, now)
        return self._made(ScaleChange(now, action, role, worker,
                                      _reason(obs, current, target, step), current.attainment,
                                      step.attainment, *split), now)

    def _idle(self, obs: Observation, now: float) -> list[Decision]:
        """No traffic: a worker that holds nothing goes while the cluster is above its
        minimum size (``max_workers`` set), else hold."""
        c = self.config
        low, _ = c.size_bounds(len(obs.workers))
        spare = {"prefill": len(obs.of_role("prefill")) - c.min_prefill,
                 "decode": len(obs.of_role("decode")) - c.min_decode}
        role = max(("prefill", "decode"), key=lambda r: spare[r])
        if len(obs.workers) <= low or spare[role] <= 0:
            return self._hold("no_traffic")
        num_p = len(obs.of_role("prefill")) - (role == "prefill")
        self.wanted = (num_p, len(obs.workers) - 1 - num_p)
        worker = _least_held(obs, role)
        if self.pending is not None or now - self.last_change_at < c.dwell_s or worker.held:
            return self._hold("no_traffic")
        self.pending = (len(obs.workers) - 1, now)
        return self._made(ScaleChange(now, REMOVE, role, worker.worker_id, "no traffic in the "
                                      "window", 1.0, 1.0, *self.wanted), now)

    def _repair(self, obs: Observation, now: float) -> list[Decision]:
        """A split outside its roles' bounds (a worker of a role died, an autoscaler
        removed or added one, the bounds changed): one worker of the role over its bounds,
        or of the other role, switches towards them if the other role can take it; else
        hold ("bounds")."""
        c, n = self.config, len(obs.workers)
        prefill, decode = len(obs.of_role("prefill")), len(obs.of_role("decode"))
        inf = n + 1
        max_p, max_d = (inf if m is None else m for m in (c.max_prefill, c.max_decode))
        if (prefill < c.min_prefill or decode > max_d) and decode > c.min_decode \
                and prefill < max_p:
            shrink, grow = "decode", "prefill"
        elif (decode < c.min_decode or prefill > max_p) and prefill > c.min_prefill \
                and decode < max_d:
            shrink, grow = "prefill", "decode"
        elif n > max_p + max_d and c.max_workers is not None:  # too many for the caps
            return self._shrink_to_caps(obs, now, "prefill" if prefill > max_p else "decode")
        elif n < c.size_bounds(n)[0] and (prefill < c.min_prefill or decode < c.min_decode):
            return self._grow_to_floor(obs, now, "prefill" if prefill < c.min_prefill
                                       else "decode")  # too few, and no switch can help
        else:
            return self._hold("bounds")
        worker = _least_held(obs, shrink)
        self.wanted = (prefill + (1 if grow == "prefill" else -1), n - prefill
                       - (1 if grow == "prefill" else -1))
        return self._made(RoleChange(now, worker.worker_id, shrink, grow,
                                     f"{prefill}P+{decode}D is outside {_bounds(c)}",
                                     0.0, 0.0),
                          now)

    def _grow_to_floor(self, obs: Observation, now: float, role: str) -> list[Decision]:
        """Fewer workers than ``min_workers`` and ``role`` under its floor, which no switch
        can lift (the other role is at its own): a worker of ``role`` is added, once the
        last scale step is seen."""
        if self.pending is not None:
            return self._hold("scaling")
        n, prefill = len(obs.workers), len(obs.of_role("prefill"))
        split = (prefill + 1, n - prefill) if role == "prefill" else (prefill, n - prefill + 1)
        self.wanted, self.pending = split, (n + 1, now)
        return self._made(ScaleChange(now, ADD, role, None, f"{prefill}P+{n - prefill}D is "
                                      f"under {_bounds(self.config)}", 0.0, 0.0, *split), now)

    def _shrink_to_caps(self, obs: Observation, now: float, role: str) -> list[Decision]:
        """More workers than the roles' caps allow together: one of ``role`` (over its
        cap) goes, once the last scale step is seen."""
        if self.pending is not None:
            return self._hold("scaling")
        n, prefill = len(obs.workers), len(obs.of_role("prefill"))
        split = (prefill - 1, n - prefill) if role == "prefill" else (prefill, n - prefill - 1)
        self.wanted, self.pending = split, (n - 1, now)
        worker = _least_held(obs, role)
        return self._made(ScaleChange(now, REMOVE, role, worker.worker_id,
                                      f"{prefill}P+{n - prefill}D is more than "
                                      f"{_bounds(self.config)} allow", 0.0, 0.0, *split), now)

    def _made(self, decision: Decision, now: float) -> list[Decision]:
        self.decisions.append(decision)
        self.last_change_at, self.held = now, ""
        return [decision]

    def _hold(self, why: str) -> list[Decision]:
        self.held = why
        return []


def _best(options: list[Prediction], current_p: int) -> Prediction:
    """The best split; of equals, the one nearest ``current_p`` prefill workers."""
    return max(options, key=lambda o: (round(o.attainment, 9), -abs(o.num_prefill - current_p)))


def _least_held(obs: Observation, role: str) -> WorkerState:
    return min(obs.of_role(role), key=lambda w: (w.held, w.worker_id))


def _reason(obs: Observation, current: Prediction, best: Prediction, step: Prediction) -> str:
    t = obs.traffic
    waits = [w.queue_wait_s for w in obs.workers if w.queue_wait_s > 0]
    seen = [f"{t.rate:.2f} req/s of {t.prompt_tokens:.0f}+{t.output_tokens:.0f} tokens"]
    if waits:
        seen.append(f"prefill queue {max(waits):.2f}s")
    if obs.ttft_s is not None:
        seen.append(f"TTFT {obs.ttft_s:.2f}s")
    if obs.itl_s is not None:
        seen.append(f"ITL {obs.itl_s * 1000:.0f}ms")
    return (f"{', '.join(seen)}: predicted attainment {current.attainment:.2f} at "
            f"{_split(current)}, {step.attainment:.2f} at {_split(step)}"
            + (f" (best {best.attainment:.2f} at {_split(best)})" if best != step else ""))


def _bounds(c: PlannerConfig) -> str:
    def cap(m: int | None) -> str:
        return "any" if m is None else str(m)
    return (f"the roles' bounds (prefill {c.min_prefill}..{cap(c.max_prefill)}, "
            f"decode {c.min_decode}..{cap(c.max_decode)})")


def _split(p: Prediction) -> str:
    return f"{p.num_prefill}P+{p.num_decode}D"

