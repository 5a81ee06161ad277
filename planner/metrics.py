"""The planner's Prometheus metrics (prometheus-client), on its ``--metrics-port``:

- ``pdserve:planner_decisions_total{action, reason}``: every decision of the leading
  planner — ``action="switch"`` with ``reason="to_prefill"`` or ``"to_decode"``,
  ``action="hold"`` with the reason it moved nothing (``planner.policy.HOLDS``:
  ``no_traffic``, ``bounds``, ``gain``, ``dwell``, ``scaling``), ``action="add"`` / ``"remove"`` with
  the worker's role (a scale step, ``--max-workers``), ``action="failed"`` when a worker
  refused or did not answer a switch, or Redis did not take a scale target
  (``reason="refused"`` / ``"unreachable"``), or a switch made could not move the
  worker's decoding requests (``reason="moves"``; the switch is counted too);
- ``pdserve:planner_workers{role}`` and ``pdserve:planner_desired_workers{role}``
  (gauges): the workers serving each role now, and the split the planner wants (with
  ``--max-workers``, their sum is the cluster size it wants: an autoscaler's input);
- ``pdserve:planner_predicted_attainment`` (gauge, 0..1): the current split's predicted SLO
  attainment at the last decision;
- ``pdserve:planner_leader`` (gauge): 1 while this planner leads, 0 while it waits.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.policy import HOLDS, ROLES


class PlannerMetrics:
    """Every metric of one planner process (see the module doc)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.decisions = Counter("pdserve:planner_decisions", "The planner's decisions",
                                 ["action", "reason"], registry=r)
        self.workers = Gauge("pdserve:planner_workers", "Workers serving each role",
                             ["role"], registry=r)
        self.desired = Gauge("pdserve:planner_desired_workers",
                             "The split the planner predicts best", ["role"], registry=r)
        self.predicted = Gauge("pdserve:planner_predicted_attainment",
                               "The current split's predicted SLO attainment", registry=r)
        self.leader = Gauge("pdserve:planner_leader", "1 while this planner leads", registry=r)
        for role in ROLES:
            self.decisions.labels("switch", f"to_{role}")
            self.decisions.labels("add", role)
            self.decisions.labels("remove", role)
            self.workers.labels(role)
            self.desired.labels(role)
        for why in HOLDS:
            self.decisions.labels("hold", why)
