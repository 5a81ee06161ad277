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

A note also keeps the full-block hashes of the last ``PROMPTS_PER_NOTE`` prompts that
landed under it (at most ``MAX_NOTED_BLOCKS`` blocks each): ``held_blocks`` says how many
leading blocks of a prompt the worker holds by them, which conditional disaggregation
reads where the index lags (a prompt held all but a short tail is prefilled there).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

WINDOW_S = 2.0
MAX_NOTES = 4096
PROMPTS_PER_NOTE = 32
MAX_NOTED_BLOCKS = 1024


class RecentKV:
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 window_s: float = WINDOW_S, max_notes: int = MAX_NOTES) -> None:
        self._clock = clock
        self._window_s = window_s
        self._max_notes = max_notes
        # (worker, first block) -> (when, the last prompts' hashes); oldest first
        self._noted: OrderedDict[tuple[str, bytes], tuple[float, list[tuple[bytes, ...]]]] = \
            OrderedDict()

    def landed(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """``worker_id`` holds the KV of a prompt with these full-block hashes (none: a
        prompt shorter than a block, nothing to reuse)."""
        if not block_hashes:
            return
        now = self._clock()
        key = (worker_id, block_hashes[0])
        prompts = self._noted.get(key, (now, []))[1]
        prompts.append(tuple(block_hashes[:MAX_NOTED_BLOCKS]))
        del prompts[:-PROMPTS_PER_NOTE]
        self._noted[key] = (now, prompts)
        self._noted.move_to_end(key)
        while self._noted:
            oldest, (at, _) = next(iter(self._noted.items()))
            if len(self._noted) <= self._max_notes and now - at < self._window_s:
                break
            del self._noted[oldest]

    def may_hold(self, worker_id: str, block_hashes: Sequence[bytes]) -> bool:
        """Whether ``worker_id`` may hold a prefix of a prompt with these full-block hashes
        that the index does not show yet."""
        return self._note(worker_id, block_hashes) is not None

    def held_blocks(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt with these full-block hashes ``worker_id``
        holds by the prompts noted to have landed there in the window."""
        prompts = self._note(worker_id, block_hashes) or ()
        return max((common_run(noted, block_hashes) for noted in prompts), default=0)

    def _note(self, worker_id: str, block_hashes: Sequence[bytes]
              ) -> list[tuple[bytes, ...]] | None:
        if not block_hashes:
            return None
        note = self._noted.get((worker_id, block_hashes[0]))
        return note[1] if note is not None and self._clock() - note[0] < self._window_s \
            else None

    def __len__(self) -> int:
        return len(self._noted)


def common_run(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """The number of leading hashes ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
