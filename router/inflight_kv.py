"""``InFlightKV``: the prompts this router is bringing to a decode worker, each from
the moment its request starts to be placed until its KV lands there (its first token)
or the request ends, so that a request whose prompt one of them covers all but a short
tail of can wait for it to land, then compute only that tail where the KV is
(conditional disaggregation's short tail, ``router.policy.short_tail``), instead of
having the same prefix computed and sent again (``router.lifecycle.coalesce``).

A chat fleet's first turns all start with one system prompt: sent together, each would
be computed on a prefill worker and its whole KV sent to the decode worker, which holds
that system prompt from the first of them to land on. Waiting for it costs the later
ones at most the first's time to its first token (and ``MAX_WAIT_S``), and saves a
prompt's worth of KV transfer each.

Pure: the waits are ``asyncio.Event``s the router's loop sets (``ended``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from router.recent_kv import common_run
from router.routing import uncached_tokens

MAX_WAIT_S = 1.0  # a request waits at most this long for a prefix in flight to land


@dataclass
class InFlight:
    """One request's prompt on its way to a decode worker, as that worker will key it."""

    block_hashes: tuple[bytes, ...]
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class InFlightKV:
    """See the module docstring. Used from the router's asyncio loop only; a request is
    known by any hashable ``key`` (its placement)."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, InFlight] = {}
        self._by_first: dict[bytes, set[Hashable]] = {}  # first block hash -> keys

    def sent(self, key: Hashable, block_hashes: Sequence[bytes]) -> None:
        """A request's prompt with these full-block hashes is on its way to a decode
        worker (none: shorter than a block, nothing to wait for)."""
        if block_hashes and key not in self._by_key:
            self._by_key[key] = InFlight(tuple(block_hashes))
            self._by_first.setdefault(block_hashes[0], set()).add(key)

    def ended(self, key: Hashable) -> None:
        """Its KV landed (the first token), or the request ended without it: its waiters
        go on."""
        entry = self._by_key.pop(key, None)
        if entry is None:
            return
        entry.arrived.set()
        keys = self._by_first[entry.block_hashes[0]]
        keys.discard(key)
        if not keys:
            del self._by_first[entry.block_hashes[0]]

    def covering(self, block_hashes: Sequence[bytes], num_prompt_tokens: int,
                 block_size: int, limit: int) -> InFlight | None:
        """The prompt in flight that covers the most leading blocks of this one
        (``block_hashes``, ``num_prompt_tokens``), if this one then lacks at most
        ``limit`` tokens."""
        if not block_hashes or not limit:
            return None
        best, best_run = None, 0
        for key in self._by_first.get(block_hashes[0], ()):
            entry = self._by_key[key]
            run = common_run(entry.block_hashes, block_hashes)
            if run > best_run:
                best, best_run = entry, run
        if best is None or uncached_tokens(num_prompt_tokens, block_size, best_run) > limit:
            return None
        return best

    def __len__(self) -> int:
        return len(self._by_key)
