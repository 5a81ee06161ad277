"""What a prefix cache gains and loses, as a log another thread drains (torch-free).

A ``BlockPool`` given a ``KVEventLog`` appends ``STORED`` when a block first carries a key
(``register_hash``) and ``REMOVED`` when it loses it (eviction, ``reset_prefix_cache``), in
the order they happen. A worker's publisher (``worker.kv_events``) drains the log on its
own thread and sends the operations to every router (``cluster.kv_events``), which keep an
index of which worker holds which block (``router.kv_index``).

Thread-safety: one thread appends (the engine's), one drains; ``collections.deque``'s
``append`` and ``popleft`` are atomic, so neither takes a lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.kvcache.block_hash import BlockHash

STORED = "S"
"""A block now carries this key: the worker can serve the prefix it names."""
REMOVED = "R"
"""No block carries this key any more."""

KVOp = tuple[str, BlockHash]
"""One operation: (``STORED`` or ``REMOVED``, the block's chained hash)."""


class KVEventLog:
    """Operations on one prefix cache not yet drained, oldest first."""

    def __init__(self) -> None:
        self._ops: deque[KVOp] = deque()

    def stored(self, block_hash: BlockHash) -> None:
        self._ops.append((STORED, block_hash))

    def removed(self, block_hash: BlockHash) -> None:
        self._ops.append((REMOVED, block_hash))

    def stored_all(self, block_hashes: Iterable[BlockHash]) -> None:
        """What the cache already holds when the log is attached to it."""
        for block_hash in block_hashes:
            self.stored(block_hash)

    def drain(self, limit: int | None = None) -> list[KVOp]:
        """The operations appended so far (at most ``limit``), oldest first; they leave
        the log. Safe against another thread appending meanwhile (what was appended after
        the count stays for the next drain)."""
        count = len(self._ops) if limit is None else min(limit, len(self._ops))
        pop = self._ops.popleft
        return [pop() for _ in range(count)]

    def __len__(self) -> int:
        return len(self._ops)


__all__ = ["REMOVED", "STORED", "KVEventLog", "KVOp"]
