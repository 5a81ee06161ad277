"""A typed, versioned wire form of ``EngineConfig`` for handing it to another process.

Tensor-parallel ranks are programs of their own (``engine.tp.rank_main``); their leader
hands them the configuration as JSON built from the frozen dataclasses' fields — never a
pickle. Decoding rebuilds the same dataclasses, checking every field against its
annotated type and refusing unknown or missing fields and other versions, so a leader
and a rank from different code fail loudly instead of running different models::

    {"version": 1, "engine_config": {"model": {...}, "cache": {...}, ..., "device": "cpu"}}

Torch-free, like ``engine.config``.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from engine.config import ConfigError, EngineConfig

CONFIG_WIRE_VERSION = 1
_SCALARS: tuple[type, ...] = (bool, int, float, str, type(None))


def encode_engine_config(config: EngineConfig) -> str:
    """``config`` as the versioned JSON text ``decode_engine_config`` reads back."""
    return json.dumps(engine_config_to_wire(config), sort_keys=True, allow_nan=False)


def decode_engine_config(text: str | bytes) -> EngineConfig:
    """The ``EngineConfig`` ``encode_engine_config`` wrote; raises ``ConfigError`` naming
    the field on a version mismatch, an unknown, missing or mistyped field."""
    try:
        envelope = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"engine config on the wire is not JSON: {exc}") from None
    return engine_config_from_wire(envelope)


def engine_config_to_wire(config: EngineConfig) -> dict[str, Any]:
    """The versioned envelope as plain JSON values (to nest in a larger message)."""
    return {"version": CONFIG_WIRE_VERSION, "engine_config": _to_plain(config)}


def engine_config_from_wire(envelope: Any) -> EngineConfig:
    """Inverse of ``engine_config_to_wire``; raises ``ConfigError`` like ``decode_engine_config``."""
    if not isinstance(envelope, dict) or set(envelope) != {"version", "engine_config"}:
        raise ConfigError("engine config on the wire must be {version, engine_config}")
    if envelope["version"] != CONFIG_WIRE_VERSION:
        raise ConfigError(f"engine config wire version {envelope['version']!r}; "
                          f"this engine reads version {CONFIG_WIRE_VERSION}")
    decoded = _from_plain(EngineConfig, envelope["engine_config"], "engine_config")
    assert isinstance(decoded, EngineConfig)
    return decoded


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if not isinstance(value, _SCALARS):
        raise ConfigError(f"cannot put a {type(value).__name__} on the wire: {value!r}")
    return value


def _from_plain(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from its plain form, checking each field's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown, missing = sorted(set(data) - names), sorted(names - set(data))
    if unknown or missing:
        raise ConfigError(f"{where}: unknown fields {unknown}, missing fields {missing}")
    return cls(**{name: _field(hints[name], data[name], f"{where}.{name}") for name in names})


def _field(hint: Any, value: Any, where: str) -> Any:
    """``value`` checked against ``hint`` (a scalar, a dataclass, or a union of them)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if isinstance(option, type) and dataclasses.is_dataclass(option) and isinstance(value, dict):
            return _from_plain(option, value, where)
        if type(value) is option or (option is float and type(value) is int):
            return float(value) if option is float else value
    raise ConfigError(f"{where}: {value!r} is not a {hint}")
