"""A ``kvtransfer`` sender fault hook for the handoff tests, loaded by the prefill plugin
(``PrefillKVConfig.fault_hook``) on every rank: it flips one bit of the first part of
transfer ``CORRUPT_TRANSFER_ID`` after its checksum was computed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

CORRUPT_TRANSFER_ID = 9_000
SPEC = "tests.workers.kv_faults:corrupt_one_part"


def corrupt_one_part() -> Callable[[Any, Any], None]:
    seen = [0]

    def hook(header: Any, payload: Any) -> None:
        if header.transfer_id != CORRUPT_TRANSFER_ID:
            return
        seen[0] += 1
        if seen[0] == 1:
            payload[payload.numel() // 2] ^= 0x10

    return hook
