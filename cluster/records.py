"""Records the cluster keeps in Redis, as JSON: ``WorkerRecord`` and the cluster fingerprint.

Torch-free, Redis-free: the encoding and its strict decoding only (a version field, every
key present and of its declared type, never pickle). ``cluster.registry`` stores them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from engine.kvcache.layout import KVLayout

RECORD_VERSION = 3
"""Version of the worker-record and fingerprint JSON written. Readers also take version 1
(records without ``metrics_address``) and 2 (layouts without ``protocol_version``: read as
protocol 0, so they differ from any current layout in that field) and refuse any other."""
READABLE_VERSIONS = (1, 2, 3)
ROLES = ("prefill", "decode")

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class RecordFormatError(ValueError):
    """A stored record or fingerprint is not valid JSON of the expected version and shape."""



@dataclass(frozen=True)
class WorkerLoad:
    """Load figures a worker reports on every heartbeat."""

    free_kv_blocks: int
    total_kv_blocks: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class WorkerRecord:
    """What the router learns about a worker. ``started_at`` is wall-clock seconds (epoch).

    ``grpc_address`` serves the worker's control API; ``kv_address`` is the rendezvous store
    of its KV endpoint. Both are ``host:port``. ``draining``: it is shutting down (takes no
    new work, and no planned move: ``cluster.moves``); written only when set, so that a
    reader without the field skips only the records of workers on their way out.
    """

    worker_id: str
    role: str
    grpc_address: str
    kv_address: str
    tensor_parallel_size: int
    layout: KVLayout
    free_kv_blocks: int
    total_kv_blocks: int
    num_running: int
    num_waiting: int
    started_at: float
    metrics_address: str = ""
    draining: bool = False

    def __post_init__(self) -> None:
        check_name("worker_id", self.worker_id)
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        _check_address("grpc_address", self.grpc_address)
        _check_address("kv_address", self.kv_address)
        if self.metrics_address:
            _check_address("metrics_address", self.metrics_address)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for name in ("free_kv_blocks", "total_kv_blocks", "num_running", "num_waiting"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.free_kv_blocks > self.total_kv_blocks:
            raise ValueError(f"free_kv_blocks {self.free_kv_blocks} > total_kv_blocks "
                             f"{self.total_kv_blocks}")
        if not math.isfinite(self.started_at):
            raise ValueError(f"started_at must be finite, got {self.started_at}")

    @property
    def load(self) -> WorkerLoad:
        return WorkerLoad(self.free_kv_blocks, self.total_kv_blocks, self.num_running,
                          self.num_waiting)

    def with_load(self, load: WorkerLoad) -> WorkerRecord:
        return dataclasses.replace(self, **dataclasses.asdict(load))

    def to_json(self) -> str:
        body: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        body["layout"] = dataclasses.asdict(self.layout)
        body["version"] = RECORD_VERSION
        if not self.draining:
            del body["draining"]
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Strict decoding: ``RecordFormatError`` on another version, a missing or unknown
        key, a wrongly typed value or a value the constructor rejects."""
        data = _load_versioned(text, "worker record")
        version = data.pop("_version")
        if version == 1:
            data.setdefault("metrics_address", "")
        data.setdefault("draining", False)
        values = _typed_fields(cls, data, "worker record", skip=("layout",))
        try:
            return cls(layout=layout_from_dict(data["layout"], version), **values)
        except (TypeError, ValueError) as exc:
            raise RecordFormatError(f"invalid worker record: {exc}") from None


def layout_to_json(layout: KVLayout) -> str:
    return json.dumps({"version": RECORD_VERSION, "layout": dataclasses.asdict(layout)},
                      sort_keys=True, separators=(",", ":"))


def layout_from_json(text: str | bytes) -> KVLayout:
    data = _load_versioned(text, "fingerprint")
    version = data.pop("_version")
    if set(data) != {"layout"}:
        raise RecordFormatError(f"fingerprint keys must be version and layout, got {sorted(data)}")
    return layout_from_dict(data["layout"], version)


def layout_from_dict(data: object, version: int = RECORD_VERSION) -> KVLayout:
    """A layout as a record of ``version`` holds it (before 3: no protocol version; one
    written before protocol 7 has no ``kv_cache_dtype``, before 8 no ``kv_transfer_dtype``:
    "auto", so the protocol version is what differs, and is named)."""
    if not isinstance(data, dict):
        raise RecordFormatError(f"layout must be a JSON object, got {type(data).__name__}")
    if version < 3 and "protocol_version" not in data:
        data = {**data, "protocol_version": 0}
    for name in ("kv_cache_dtype", "kv_transfer_dtype"):
        if name not in data:
            data = {**data, name: "auto"}
    try:
        return KVLayout(**_typed_fields(KVLayout, data, "layout"))
    except ValueError as exc:
        raise RecordFormatError(f"invalid layout: {exc}") from None


def check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{what} must match {_NAME_RE.pattern}, got {name!r}")


def _check_address(what: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"{what} must be 'host:port', got {address!r}")


def _load_versioned(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordFormatError(f"{what} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RecordFormatError(f"{what} must be a JSON object, got {type(data).__name__}")
    version = data.pop("version", None)
    if version not in READABLE_VERSIONS:
        raise RecordFormatError(f"{what} has version {version!r}; this pdserve reads "
                                f"versions {list(READABLE_VERSIONS)}")
    data["_version"] = version
    return data


def _typed_fields(cls: type, data: dict[str, Any], what: str,
                  skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data``'s values for ``cls``'s fields (except ``skip``), type-checked: int is
    not bool, float accepts int. Unknown or missing keys fail."""
    hints = _hints(cls)
    if set(data) != set(hints):
        extra, missing = sorted(set(data) - set(hints)), sorted(set(hints) - set(data))
        raise RecordFormatError(f"{what} keys: unknown {extra}, missing {missing}")
    values: dict[str, Any] = {}
    for name, typ in hints.items():
        value = data[name]
        if name in skip:
            continue
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not typ:
            raise RecordFormatError(f"{what} field {name} must be {typ.__name__}, "
                                    f"got {type(value).__name__}")
        values[name] = value
    return values


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        hints = get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in fields(cls)}
    return _HINTS[cls]
