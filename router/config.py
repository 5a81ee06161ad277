"""The router's configuration: one frozen dataclass per concern, composed.

Standard library only: the command line builds its options from these defaults even
where the server extra is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cluster.clock import MAX_HEARTBEAT_S
from cluster.internal_tls import InternalTLS
from cluster.token import ClusterToken

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
LOCAL_PREFILL_MODES = ("never", "fallback", "always")
PREFILL_ROUTING = ("kv-aware", "affinity", "round-robin")
AFFINITY_BLOCKS = 4
"""Leading full blocks that make the prefill affinity key (64 tokens at block size 16)."""
DEFAULT_EPSILON = 0.25
"""Bounded load: a prefill worker above ``(1 + epsilon) * mean`` load is skipped."""
DEFAULT_LEASE_TTL_S = 10.0
DEFAULT_MIGRATION_LIMIT = 3
"""Migrations of one stream (its decode worker failed after tokens were streamed) before
the client gets UNAVAILABLE."""
MIN_LEASE_TTL_S = 0.1
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 64
"""kv-aware: the longest uncached tail a decode worker prefills itself (0: never). A
chat's next turn (the reply's last block and a short user turn) falls under it. Chosen by
``bench.routing``'s sweep of 0/32/64/128/256 (docs/benchmarks.md): 64 takes every later
turn of its chat workload local, where 32 takes none; above 64 nothing changed there."""


@dataclass(frozen=True)
class HandoffConfig:
    """How ``router.lifecycle`` drives a request through the workers."""

    max_attempts: int = 3
    reserve_timeout_s: float = 10.0  # Reserve returns at once; this bounds a hung worker
    affinity_blocks: int = AFFINITY_BLOCKS
    load_epsilon: float = DEFAULT_EPSILON
    # "never": no prefill worker left is UNAVAILABLE; "fallback": then the decode worker
    # prefills locally; "always": colocated mode (every request prefilled on decode)
    local_prefill: str = "never"
    # "kv-aware": the least predicted prefill work, from the KV index (router.kv_index),
    # affinity while the index cannot be trusted; "affinity": rendezvous hashing of the
    # prompt's leading blocks with bounded load; "round-robin": the next prefill worker in
    # turn (the baseline of benchmarks)
    prefill_routing: str = "kv-aware"
    # kv-aware: a prompt a decode worker holds all of but at most this many tokens is
    # prefilled there (conditional disaggregation); 0: never
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    # each attempt's lease in Redis (cluster.leases): renewed every third of it; a worker
    # frees an attempt whose lease has been gone this long
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    # a stream whose decode worker fails after its first token continues on another one
    # (the prompt and the tokens sent prefilled), at most this often; 0: never (a move a
    # draining worker offers is planned, not counted: router.lifecycle.handoff)
    migration_limit: int = DEFAULT_MIGRATION_LIMIT

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got "
                             f"{self.local_prefill_max_tokens}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.local_prefill not in LOCAL_PREFILL_MODES:
            raise ValueError(f"local_prefill must be one of {LOCAL_PREFILL_MODES}, "
                             f"got {self.local_prefill!r}")
        if self.prefill_routing not in PREFILL_ROUTING:
            raise ValueError(f"prefill_routing must be one of {PREFILL_ROUTING}, "
                             f"got {self.prefill_routing!r}")
        if not self.lease_ttl_s >= MIN_LEASE_TTL_S:
            raise ValueError(f"lease_ttl_s must be >= {MIN_LEASE_TTL_S}, got {self.lease_ttl_s}")


@dataclass(frozen=True)
class AdmissionConfig:
    """What the router accepts, queues and buffers (``router.admission``,
    ``router.core``)."""

    # requests queued or running at once; more get RESOURCE_EXHAUSTED at once
    max_inflight: int = 1024
    # prompt tokens of requests not yet at their first token (one request alone is always
    # admitted); None: no limit
    max_queued_tokens: int | None = 262144
    max_message_bytes: int = 4 << 20  # larger request messages get RESOURCE_EXHAUSTED
    default_timeout_s: float = 600.0  # deadline of a request whose client set none
    # chunks of one request waiting for a slow client; past it: RESOURCE_EXHAUSTED
    max_buffered_chunks: int = 1024
    max_n: int = 16  # choices one request may ask for (``n``); each is admitted as a request

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.max_queued_tokens is not None and self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1 or None, got "
                             f"{self.max_queued_tokens}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not self.default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be > 0, got {self.default_timeout_s}")
        if self.max_buffered_chunks < 1:
            raise ValueError(f"max_buffered_chunks must be >= 1, got {self.max_buffered_chunks}")


@dataclass(frozen=True)
class DiscoveryConfig:
    """How the router learns about workers (see ``router.workers.WorkerPool``)."""

    redis_url: str
    cluster: str = "default"
    refresh_interval_s: float = 0.5
    # a worker gone from Redis stays routable this long (past a restart's re-registration:
    # a worker's heartbeat comes at most every MAX_HEARTBEAT_S)
    keep_missing_s: float = MAX_HEARTBEAT_S + 1.0
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
class HttpConfig:
    """The OpenAI-compatible HTTP API (``router.http``), served beside gRPC on ``host``."""

    port: int = DEFAULT_HTTP_PORT  # 0: the OS picks
    chat_template: Path | None = None  # None: the model's own (router.http.chat_template)


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
    health_port: int | None = None  # also serve health alone, in plaintext, here (0: any)
    metrics_port: int | None = None  # serve /metrics here (0: any)
    http: HttpConfig | None = None  # None: no HTTP API
    # serve the internal introspection service (RouterDebug) here (0: any); None: off
    debug_port: int | None = None
    debug_host: str = "127.0.0.1"  # loopback unless asked otherwise
    # sent on every call to a worker (and the KV plane's secret); None: the plane is open
    cluster_token: ClusterToken | None = field(default=None, repr=False)
    internal_tls: InternalTLS | None = None  # mutual TLS towards the workers; None: plaintext

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
