"""Counters of the KV data plane's two roles (plain integers; read by stats calls and tests)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SenderStats:
    channels_opened: int = 0
    retries: int = 0
    parts_sent: int = 0
    bytes_sent: int = 0
    unexpected_acks: int = 0  # malformed, duplicate, late or for another part: ignored


@dataclass
class ReceiverStats:
    channels_accepted: int = 0
    channels_refused: int = 0
    busy_replies: int = 0
    opens_abandoned: int = 0  # open requests whose sender gave up before they were taken
    parts_received: int = 0
    bytes_received: int = 0
    late_parts: int = 0  # for transfers already finished (completed, failed or aborted)
    duplicate_parts: int = 0  # the same rows and heads twice for a live transfer
    unknown_parts: int = 0  # for transfers never expected (within the park timeout)
    checksum_failures: int = 0
