"""Which KV blocks hold a draft model's KV of a whole cached block, so that a request whose
prompt is found in the prefix cache finds the draft's KV there too (``engine.core.drafter``).

The draft's KV lives in a cache of its own indexed by the target's block ids, and the
prefix cache knows only the target's: a block it hands a new request holds the target's
KV of those tokens, but the draft's KV in it is right only if the draft computed that
very content there and nothing has written over it since. ``DraftBlocks`` records, per
block id, the hash of the content whose draft KV the block holds in full (the prefix
cache's chained block hash: the same hash, the same tokens after the same prefix, so the
same draft KV), and forgets a block as soon as the draft writes into it again: the
drafter says so before each of its forwards, and whoever writes the draft's cache another
way says which blocks it wrote (``DraftModel.written``). A block
reused for other content carries another hash, so the record no longer matches it; a
block filled by a request that never ran the draft (a prefill-only request, one that
does not speculate) keeps whatever draft KV it held, which the record still describes
correctly, or none. A wrong record would only make guesses worse, never a token wrong:
the target checks every guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.chunks import ScheduledChunk
from engine.core.request import Request
from engine.kvcache import BlockHash


class DraftBlocks:
    """The blocks of a KV pool of ``block_size``-token blocks whose draft KV is known."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: dict[int, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._held)

    def writing(self, chunks: Iterable[ScheduledChunk]) -> None:
        """The draft is about to write the KV of ``chunks``: their blocks' records go."""
        bs = self.block_size
        for chunk in chunks:
            first = chunk.start_position // bs
            last = (chunk.start_position + len(chunk.token_ids) - 1) // bs
            self.forget(chunk.block_ids[first:last + 1])

    def forget(self, block_ids: Iterable[int]) -> None:
        """The draft's KV in ``block_ids`` is being written: their records go."""
        for block_id in block_ids:
            self._held.pop(block_id, None)

    def record(self, request: Request, block_ids: Sequence[int], start: int, valid: int) -> int:
        """The draft's KV of ``request``'s first ``valid`` tokens is in ``block_ids`` (its
        block table), the blocks from ``start`` on not recorded yet: records each full one
        whose hash the request knows; returns the blocks recorded in all (the next call's
        ``start``)."""
        end = min(valid // self.block_size, len(request.block_hashes), len(block_ids))
        for j in range(start, end):
            self._held[block_ids[j]] = request.block_hashes[j]
        return max(start, end)

    def prefix(self, request: Request, block_ids: Sequence[int], limit: int) -> int:
        """Tokens at the start of ``request`` (at most ``limit``, whole blocks) whose draft
        KV its blocks already hold."""
        n, most = 0, min(limit // self.block_size, len(request.block_hashes), len(block_ids))
        while n < most and self._held.get(block_ids[n]) == request.block_hashes[n]:
            n += 1
        return n * self.block_size
