"""The planner's scale steps, I/O-free: whether one worker more, or one fewer, is predicted
better than the best split of the workers there are (``planner.policy.Planner.decide``
asks when ``PlannerConfig.max_workers`` is set).

    up = best split of n + 1 .. max_workers    here = best of n    down = best of n - 1
    add a worker     when up   >= max(current, here) + min_gain  (switching is not enough)
                     and no switch gains min_gain (a switch, at once, comes first)
    remove a worker  when down >= here - scale_down_slack, down > 0  (it is not needed)

``min_gain`` > ``scale_down_slack`` is the hysteresis: a worker added because it gained
``min_gain`` is not removed while the traffic stays. Without traffic, a worker is removed
while the cluster is above ``min_workers`` (the one holding least, of the role with more
workers than it must keep). Each step is one worker, its role the one the chosen split
grows or shrinks; role switches then bring the split to the best one.

Who acts on a ``ScaleChange`` is the cluster's launcher: the planner publishes the counts it
wants (``cluster.scale``) and ``pdserve up --ray`` starts or drains worker actors; on
Kubernetes a HorizontalPodAutoscaler reads ``pdserve:planner_desired_workers``.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.capacity import Prediction

ADD, REMOVE = "add", "remove"


@dataclass(frozen=True)
class ScaleChange:
    """A decision: ``add`` a worker of ``role``, or ``remove`` worker ``worker_id`` (of
    ``role``); the cluster then has ``num_prefill`` + ``num_decode`` workers."""

    t: float
    action: str  # ADD or REMOVE
    role: str
    worker_id: str | None  # the worker to remove; None for ADD
    reason: str
    predicted_before: float
    predicted_after: float
    num_prefill: int
    num_decode: int


def scale_choice(current: Prediction, here: Prediction, up: Prediction | None,
                 down: Prediction | None, *, min_gain: float, slack: float
                 ) -> tuple[str, Prediction] | None:
    """``(ADD, up)``, ``(REMOVE, down)`` or None (see the module doc); ``up`` / ``down``
    are None where the bounds allow no such step. A cluster the model sees failing at
    every size (all 0) keeps its workers."""
    if up is not None and up.attainment >= max(current.attainment, here.attainment) + min_gain:
        return ADD, up
    if down is not None and down.attainment > 0 and down.attainment >= here.attainment - slack:
        return REMOVE, down
    return None


def step_role(action: str, num_prefill: int, target: Prediction) -> str:
    """The role the added (or removed) worker has, for the split to move towards
    ``target`` from one of ``num_prefill`` prefill workers."""
    if action == ADD:
        return "prefill" if target.num_prefill > num_prefill else "decode"
    return "prefill" if target.num_prefill < num_prefill else "decode"
