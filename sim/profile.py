"""A worker profile: what the simulator needs to know of one model on one machine, and
the step-time model built from it. Torch-free; JSON on disk.

Schema (``SCHEMA``; every time in seconds, every size in bytes)::

    {"schema": "pdserve.sim.profile/1",
     "source": "measured" | "derived",   # derived: roofline arithmetic, not a measurement
     "description": "free text: machine, model, how it was made",
     "model": {"name": str, "num_layers": int, "kv_bytes_per_token": int,
               "block_size": int, "max_model_len": int},
     "steps": {"<tp>": {"base_s": f, "multi_token_s": f, "prefill_step_s": f,
                        "per_prefill_token_s": f, "per_prefill_attention_s": f,
                        "per_decode_seq_s": f, "per_decode_context_s": f,
                        "num_kv_blocks": int}, ...},
     "transfer": {"latency_s": f, "bytes_per_s": f},
     "router": {"overhead_s": f},   # validate, tokenize, admit: per request
     "handoff": {"overhead_s": f},  # the attempt's calls (reserve, prefill, admit)
     "points": {...}}               # optional: the measurements the fit came from

One step of a worker computing a ``SchedulerOutput`` takes::

    base_s                                    # weights read once per step, launch costs
    + multi_token_s      if it computes more than one token (matrix products, where one
                         token's are matrix-vector ones: a CPU's differ by a fixed cost)
    + prefill_step_s     if it holds a prefill chunk (the prefill path's fixed costs)
    + per_prefill_token_s     * prefill tokens
    + per_prefill_attention_s * Σ chunk tokens × (tokens before them + half the chunk)
    + per_decode_seq_s        * decode sequences
    + per_decode_context_s    * Σ decode sequences' context (their KV read)

(``StepModel.step_s``): a linear model in the quantities a forward pass's cost grows
with, and two fixed costs of a step's kind. ``bench.profile`` fits it to measured steps by
least squares; ``sim.roofline`` derives it from bandwidth and FLOP figures (its two fixed
costs 0). ``steps`` is keyed by tensor-parallel size; ``multi_token_s`` and
``prefill_step_s`` may be left out (0: profiles written before them).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.core.scheduler import SchedulerOutput

SCHEMA = "pdserve.sim.profile/1"
_START = operator.attrgetter("start_position")  # of a ScheduledChunk
SOURCES = ("measured", "derived")
STEP_TERMS = ("base_s", "multi_token_s", "prefill_step_s", "per_prefill_token_s",
              "per_prefill_attention_s", "per_decode_seq_s", "per_decode_context_s")
OPTIONAL_TERMS = ("multi_token_s", "prefill_step_s")  # 0 where a profile has none
FIXED_TERMS = ("base_s", "multi_token_s", "prefill_step_s")  # a step's, whatever its size


class ProfileError(ValueError):
    """A profile that cannot be used, and why (which field, what was found)."""


@dataclass(frozen=True)
class StepModel:
    """One worker's step time (see the module doc) and its KV pool."""

    base_s: float
    per_prefill_token_s: float
    per_prefill_attention_s: float
    per_decode_seq_s: float
    per_decode_context_s: float
    num_kv_blocks: int
    multi_token_s: float = 0.0
    prefill_step_s: float = 0.0

    def step_s(self, out: SchedulerOutput) -> float:
        """Seconds the step ``out`` takes on this worker."""
        return self.time_s(step_quantities(out))

    def time_s(self, quantities: Sequence[float]) -> float:
        """Seconds a step of ``quantities`` (one per ``STEP_TERMS``, in that order) takes."""
        b, m, p, t, a, s, c = quantities
        return (self.base_s * b + self.multi_token_s * m + self.prefill_step_s * p
                + self.per_prefill_token_s * t + self.per_prefill_attention_s * a
                + self.per_decode_seq_s * s + self.per_decode_context_s * c)


def step_quantities(out: SchedulerOutput) -> tuple[float, ...]:
    """What the step ``out``'s time grows with: the multiplier of each of ``STEP_TERMS``,
    in that order (the module doc's formula). ``StepModel.step_s`` weighs them;
    ``bench.profile`` fits the weights to measured steps."""
    prefill_tokens = attention = 0.0
    for chunk in out.prefills:
        n = len(chunk.token_ids)
        prefill_tokens += n
        attention += n * (chunk.start_position + n / 2)
    decodes = out.decodes
    context = sum(map(_START, decodes)) + len(decodes)  # each attends to its start + 1
    return (1.0, float(prefill_tokens + len(decodes) > 1), float(bool(out.prefills)),
            prefill_tokens, attention, float(len(decodes)), float(context))


def chunk_quantities(num_tokens: int, start: int = 0) -> tuple[float, ...]:
    """``step_quantities`` of a step holding one prefill chunk alone (``num_tokens``
    tokens after ``start`` computed ones)."""
    n = float(num_tokens)
    return (1.0, float(n > 1), 1.0, n, n * (start + n / 2), 0.0, 0.0)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    num_layers: int
    kv_bytes_per_token: int  # all layers, K and V, at the KV cache's dtype
    block_size: int
    max_model_len: int


@dataclass(frozen=True)
class Profile:
    """A whole profile (see the module doc)."""

    source: str
    model: ModelFacts
    steps: Mapping[int, StepModel]
    transfer_latency_s: float
    transfer_bytes_per_s: float
    router_overhead_s: float
    handoff_overhead_s: float
    description: str = ""
    points: Mapping[str, Any] = field(default_factory=dict)

    def step(self, tp: int) -> StepModel:
        """The step model at tensor-parallel size ``tp`` (``ProfileError`` naming those
        the profile has)."""
        if tp not in self.steps:
            raise ProfileError(f"the profile has no steps at TP {tp} (it has TP "
                               f"{', '.join(map(str, sorted(self.steps)))})")
        return self.steps[tp]

    def transfer_s(self, num_bytes: int) -> float:
        """Seconds to move ``num_bytes`` of KV from a prefill to a decode worker."""
        return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s

    def block_bytes(self) -> int:
        return self.model.kv_bytes_per_token * self.model.block_size

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "source": self.source, "description": self.description,
                "model": asdict(self.model),
                "steps": {str(tp): asdict(s) for tp, s in sorted(self.steps.items())},
                "transfer": {"latency_s": self.transfer_latency_s,
                             "bytes_per_s": self.transfer_bytes_per_s},
                "router": {"overhead_s": self.router_overhead_s},
                "handoff": {"overhead_s": self.handoff_overhead_s},
                "points": dict(self.points)}


def load(path: str | Path) -> Profile:
    """The profile at ``path`` (``ProfileError`` naming the file and what is wrong)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{path}: cannot read a profile: {exc}") from None
    try:
        return from_json(data)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None


def from_json(data: Any) -> Profile:
    """A profile from its JSON form (``ProfileError`` naming the field that is wrong)."""
    obj = _mapping(data, "the profile")
    if obj.get("schema") != SCHEMA:
        raise ProfileError(f"schema is {obj.get('schema')!r}, this simulator reads {SCHEMA!r}")
    source = obj.get("source")
    if source not in SOURCES:
        raise ProfileError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    model = _mapping(obj.get("model"), "model")
    facts = ModelFacts(name=str(model.get("name", "")),
                       num_layers=_int(model, "num_layers", "model"),
                       kv_bytes_per_token=_int(model, "kv_bytes_per_token", "model"),
                       block_size=_int(model, "block_size", "model"),
                       max_model_len=_int(model, "max_model_len", "model"))
    steps_in = _mapping(obj.get("steps"), "steps")
    if not steps_in:
        raise ProfileError("steps is empty: give the step model of at least one TP size")
    steps: dict[int, StepModel] = {}
    for key, value in steps_in.items():
        if not str(key).isdigit() or int(key) < 1:
            raise ProfileError(f"steps is keyed by TP size (1, 2, ...), got {key!r}")
        where = f"steps.{key}"
        s = _mapping(value, where)
        seconds = {name: _seconds(s, name, where) for name in STEP_TERMS
                   if name in s or name not in OPTIONAL_TERMS}
        steps[int(key)] = StepModel(**seconds, num_kv_blocks=_int(s, "num_kv_blocks", where))
    transfer = _mapping(obj.get("transfer"), "transfer")
    bandwidth = _seconds(transfer, "bytes_per_s", "transfer")
    if bandwidth <= 0:
        raise ProfileError("transfer.bytes_per_s must be > 0")
    return Profile(source=source, model=facts, steps=steps,
                   transfer_latency_s=_seconds(transfer, "latency_s", "transfer"),
                   transfer_bytes_per_s=bandwidth,
                   router_overhead_s=_seconds(_mapping(obj.get("router"), "router"),
                                              "overhead_s", "router"),
                   handoff_overhead_s=_seconds(_mapping(obj.get("handoff"), "handoff"),
                                               "overhead_s", "handoff"),
                   description=str(obj.get("description", "")),
                   points=_mapping(obj.get("points", {}), "points"))


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProfileError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _int(obj: Mapping[str, Any], name: str, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{where}.{name} must be a positive integer, got {value!r}")
    return value


def _seconds(obj: Mapping[str, Any], name: str, where: str) -> float:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0 \
            or value == float("inf"):
        raise ProfileError(f"{where}.{name} must be a finite number >= 0, got {value!r}")
    return float(value)
