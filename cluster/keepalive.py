"""gRPC keepalive settings shared by the router and the workers (torch-free, no imports).

Servers ping every peer connection every ``PING_S`` and drop one that does not answer
within ``PING_TIMEOUT_S``: a client or router host that vanished without closing its
sockets (a partition, a SIGSTOPped process) is noticed within about 30 s and its calls
are cancelled, which frees what the callee held for them. Channels ping too, so a callee
that vanished is noticed by the caller; servers accept those pings (at most one every
``MIN_PEER_PING_S``, also while no call is open) instead of answering GOAWAY
"too_many_pings".

Message size: the internal API's messages may be up to ``INTERNAL_MAX_MESSAGE_BYTES``
(workers' servers and the router's channels to them), far above what any request the
router admits can make (its public messages are at most 4 MiB by default; a Reserve or a
Prefill carries the validated prompt, sampling and ids): an internal call is never
refused for its size.
"""

from __future__ import annotations

INTERNAL_MAX_MESSAGE_BYTES = 64 << 20
PING_S = 10.0
PING_TIMEOUT_S = 10.0
MIN_PEER_PING_S = 5.0

SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", int(PING_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(MIN_PEER_PING_S * 1000)),
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a pinging peer
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_concurrent_streams", 1 << 16),  # concurrent calls on one connection
)

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", int(PING_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(PING_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

INTERNAL_SERVER_OPTIONS = (
    *SERVER_OPTIONS,
    ("grpc.max_receive_message_length", INTERNAL_MAX_MESSAGE_BYTES),
)
