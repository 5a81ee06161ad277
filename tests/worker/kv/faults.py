"""A ``kvtransfer`` sender fault hook for the KV transfer tests, loaded by the KV rank
plugin (``KVPlaneConfig.fault_hook``) on every rank: it flips one bit of the first part of
transfer ``CORRUPT_TRANSFER_ID`` after its checksum was computed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CORRUPT_TRANSFER_ID = 9_000
SPEC = "tests.worker.kv.faults:corrupt_one_part"
CORRUPT_NUM_TOKENS = 97
"""``corrupt_first_of_length`` corrupts the first transfer of a prompt this long."""
FIRST_OF_LENGTH_SPEC = "tests.worker.kv.faults:corrupt_first_of_length"


def corrupt_one_part() -> Callable[[Any, Any], None]:
    seen = [0]

    def hook(header: Any, payload: Any) -> None:
        if header.transfer_id != CORRUPT_TRANSFER_ID:
            return
        seen[0] += 1
        if seen[0] == 1:
            payload[payload.numel() // 2] ^= 0x10

    return hook


def corrupt_first_of_length() -> Callable[[Any, Any], None]:
    """For worker processes (transfer ids are the router's): flips one bit of the first
    part of the first transfer of a ``CORRUPT_NUM_TOKENS``-token prompt, once per rank."""
    corrupted: list[int] = []

    def hook(header: Any, payload: Any) -> None:
        if header.num_tokens != CORRUPT_NUM_TOKENS or payload.numel() == 0:
            return
        if not corrupted:
            corrupted.append(header.transfer_id)
            payload[payload.numel() // 2] ^= 0x10

    return hook
