"""The planner's latest scale step, torch-free.

The leading planner (``pdserve planner --max-workers N``) writes one at each scale
decision (``planner.scaling``); whoever can start and stop workers applies each new one
once: ``pdserve up --ray`` adds or drains one worker actor, within its own
``--min-workers`` / ``--max-workers`` (``deploy.ray.scaling``). On Kubernetes the counts
reach a HorizontalPodAutoscaler as ``pdserve:planner_desired_workers`` instead.

    step = ScaleTarget(action="add", role="decode", worker_id="", num_prefill=1,
                       num_decode=3, reason="...", written_at=time.time())
    registry.set_scale_target(step.to_json())
    ScaleTarget.from_json(registry.scale_target())

``action`` "add": one more worker, started in ``role``; "remove": drain ``worker_id``
(the one holding least of the role that shrinks). ``num_prefill`` / ``num_decode``: the
split the planner wants after the step (for the operator; a step, not the counts, is
what is applied: a planner that missed a worker in its window cannot shrink the cluster
by more than it decided). ``written_at`` (Unix seconds) tells a new step from one already
applied, and lets a launcher ignore steps written before it started (a Redis an earlier
cluster used).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from cluster.records import RecordFormatError

SCALE_VERSION = 1
ROLES = ("prefill", "decode")
ACTIONS = ("add", "remove")


@dataclass(frozen=True)
class ScaleTarget:
    """See the module doc."""

    action: str  # ACTIONS
    role: str  # of the worker added or removed
    worker_id: str  # the worker to remove ("" for "add")
    num_prefill: int
    num_decode: int
    reason: str
    written_at: float

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if (self.action == "remove") != bool(self.worker_id):
            raise ValueError("a removal names its worker_id, an addition none")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a split needs num_prefill >= 0 and num_decode >= 1, "
                             f"got {self.num_prefill} and {self.num_decode}")

    def to_json(self) -> str:
        return json.dumps({"version": SCALE_VERSION, **asdict(self)}, sort_keys=True,
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ScaleTarget:
        """Strict: ``RecordFormatError`` on another version, a missing or unknown key, a
        wrongly typed or unusable value."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecordFormatError(f"scale target is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.pop("version", None) != SCALE_VERSION:
            raise RecordFormatError(f"scale target: not version {SCALE_VERSION}")
        types = {f.name: f.type for f in fields(cls)}
        if set(data) != set(types):
            raise RecordFormatError(f"scale target keys: unknown {sorted(set(data) - set(types))},"
                                    f" missing {sorted(set(types) - set(data))}")
        for name, typ in types.items():
            value = data[name]
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  if typ == "float" else type(value).__name__ == typ)
            if not ok:
                raise RecordFormatError(f"scale target field {name} must be {typ}")
        try:
            return cls(**data)
        except ValueError as exc:
            raise RecordFormatError(f"invalid scale target: {exc}") from None
