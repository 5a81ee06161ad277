"""The router's configuration: one frozen dataclass per concern, composed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from router.handoff import HandoffConfig

DEFAULT_PORT = 50051


@dataclass(frozen=True)
class AdmissionConfig:
    """What the router accepts before any work."""

    max_inflight: int = 256  # requests in flight at once; more get RESOURCE_EXHAUSTED
    # prompt tokens of requests not yet at their first token (one request alone is always
    # admitted); None: no limit
    max_queued_tokens: int | None = 65536
    max_message_bytes: int = 4 << 20  # larger request messages get RESOURCE_EXHAUSTED
    default_timeout_s: float = 600.0  # deadline of a request whose client set none

    def __post_init__(self) -> None:
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_queued_tokens is not None and self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1 or None, got "
                             f"{self.max_queued_tokens}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not self.default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be > 0, got {self.default_timeout_s}")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How the router learns about workers (see ``router.workers.WorkerPool``)."""

    redis_url: str
    cluster: str = "default"
    refresh_interval_s: float = 0.5
    keep_missing_s: float = 6.0  # a worker gone from Redis stays routable this long
    suspect_s: float = 5.0  # a worker whose call failed in transport is skipped this long


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of the public port's TLS certificate (chain) and private key."""

    cert_file: Path
    key_file: Path

    def credentials(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain); ``ValueError`` naming an unreadable file."""
        try:
            return self.key_file.read_bytes(), self.cert_file.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read TLS file {exc.filename}: {exc.strerror}") from None


@dataclass(frozen=True)
class RouterConfig:
    model_dir: Path
    discovery: DiscoveryConfig
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    model_name: str | None = None  # default: the model directory's name
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    handoff: HandoffConfig = field(default_factory=HandoffConfig)
    grace_s: float = 5.0  # on SIGTERM, in-flight requests get this long to finish
    api_key: str | None = field(default=None, repr=False)  # None: no authentication
    tls: TLSFiles | None = None  # None: plaintext

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
