"""``KVPlaneConfig``: the settings of a worker's KV rank plugin, handed to every rank as
JSON (``EngineConfig.rank_plugin_config``; never pickled)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from kvtransfer import TransferConfig
from kvtransfer.config import LOOPBACK

C = TypeVar("C", bound="JsonConfig")


class JsonConfig:
    """Mixin of frozen config dataclasses that cross to the ranks as JSON."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[C], raw: str) -> C:
        """Parse; unknown or missing keys raise ``ValueError``."""
        try:
            return cls(**json.loads(raw))
        except TypeError as exc:
            raise ValueError(f"bad {cls.__name__}: {exc}") from exc


@dataclass(frozen=True)
class KVPlaneConfig(JsonConfig):
    """How every rank of a worker sends and receives KV.

    ``bind_host`` is where rank 0's rendezvous store listens (may be a wildcard) on
    ``store_port`` (0: it binds any free port; the receive leader reads the one it got);
    ``advertise_host`` is what other workers are told, and what the data plane's groups
    bind (default: ``bind_host``). ``fault_hook``: tests only, ``"module:factory"`` of a
    ``kvtransfer`` sender fault hook. ``auth_keys``: the KV plane's keys, hex (derived from
    the cluster token, ``cluster.token.ClusterToken.kv_keys``; empty without a token)."""

    model_fingerprint: str
    timeout_s: float = 30.0  # a transfer not complete this long (after it started) fails
    max_channels: int = 8
    part_bytes: int = 4 << 20
    bind_host: str = LOOPBACK
    store_port: int = 0
    advertise_host: str | None = None
    fault_hook: str | None = None
    auth_keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "auth_keys", tuple(self.auth_keys))  # a list from JSON

    @property
    def reachable_host(self) -> str:
        return self.advertise_host or self.bind_host

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(timeout_s=self.timeout_s, max_channels=self.max_channels,
                              part_bytes=self.part_bytes, bind_host=self.reachable_host,
                              auth_keys=tuple(bytes.fromhex(k) for k in self.auth_keys))
