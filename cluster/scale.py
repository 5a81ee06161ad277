"""The cluster's scale target: how many workers the planner wants, torch-free.

The leading planner (``pdserve planner --max-workers N``) writes it at each scale step
(``planner.scaling``); whoever can start and stop workers acts on the latest one:
``pdserve up --ray`` adds or drains worker actors within its ``--min-workers`` /
``--max-workers`` (``deploy.ray.scaling``). On Kubernetes the same counts reach a
HorizontalPodAutoscaler as ``pdserve:planner_desired_workers``.

    target = ScaleTarget(num_prefill=1, num_decode=3, add_role="decode", remove="",
                         reason="...", written_at=time.time())
    registry.set_scale_target(target.to_json())
    ScaleTarget.from_json(registry.scale_target())

``add_role``: the role a worker added now should start in; ``remove``: the worker the
planner chose to drain (the one holding least of the role that shrinks; "" when it
added). ``written_at`` (Unix seconds) lets a launcher ignore a target written before it
started (a Redis shared with an earlier cluster).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from cluster.records import RecordFormatError

SCALE_VERSION = 1
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ScaleTarget:
    """See the module doc."""

    num_prefill: int
    num_decode: int
    add_role: str
    remove: str
    reason: str
    written_at: float

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a scale target needs num_prefill >= 0 and num_decode >= 1, "
                             f"got {self.num_prefill} and {self.num_decode}")
        if self.add_role not in ROLES:
            raise ValueError(f"add_role must be one of {ROLES}, got {self.add_role!r}")

    @property
    def total(self) -> int:
        return self.num_prefill + self.num_decode

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
