"""``RecentKV``: the prompts whose KV one router saw land on a decode worker in the last
few seconds, which its KV index (fed by the workers' KV events, ``router.kv_feed``) may
not list yet. Pure, on an injected clock: the simulator keeps one per simulated router.

The index learns of a block a publisher period (20 ms) and a stream read after the worker
keyed it; a chat's next turn, sent the moment its last reply ended, can arrive sooner, on
a loaded host well sooner. By the index alone the worker then holds none of that prompt,
and the router would send the Prefill ahead of the Reserve (``router.lifecycle.ahead``),
naming no blocks to skip: the whole prompt would travel again. So the router notes each
prompt's first full block, by decode worker, when the worker streams its first token and
when it finishes (its blocks are keyed by then), and sends nothing ahead to a worker that
may hold a prompt starting with that block: its Reserve's reply says what to skip.

A note lasts ``window_s`` (long past the index's lag while its feed works; while it does
not, the index is not trusted and nothing goes ahead anyway); at most ``max_notes`` are
kept, the oldest dropped first. A stale note costs one Reserve's round trip before the
Prefill, never a token.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

WINDOW_S = 2.0
MAX_NOTES = 4096


class RecentKV:
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 window_s: float = WINDOW_S, max_notes: int = MAX_NOTES) -> None:
        self._clock = clock
        self._window_s = window_s
        self._max_notes = max_notes
        self._noted: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # oldest first

    def landed(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """``worker_id`` holds the KV of a prompt with these full-block hashes (none: a
        prompt shorter than a block, nothing to reuse)."""
        if not block_hashes:
            return
        now = self._clock()
        key = (worker_id, block_hashes[0])
        self._noted[key] = now
        self._noted.move_to_end(key)
        while self._noted:
            oldest, at = next(iter(self._noted.items()))
            if len(self._noted) <= self._max_notes and now - at < self._window_s:
                break
            del self._noted[oldest]

    def may_hold(self, worker_id: str, block_hashes: Sequence[bytes]) -> bool:
        """Whether ``worker_id`` may hold a prefix of a prompt with these full-block hashes
        that the index does not show yet."""
        if not block_hashes:
            return False
        at = self._noted.get((worker_id, block_hashes[0]))
        return at is not None and self._clock() - at < self._window_s

    def __len__(self) -> int:
        return len(self._noted)
