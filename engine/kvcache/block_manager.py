"""Per-request block tables over a ``BlockPool``, with prefix caching and pins.

Torch-free: the schedulers and tests use it with integer ids and counts only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kvcache.block_hash import BlockHash
from engine.kvcache.block_pool import BlockPool, KVCacheIntegrityError
from engine.kvcache.events import KVEventLog
from engine.tp.sharding import num_blocks_for


@dataclass(frozen=True)
class KVCacheUsage:
    """Block counts by category; ``free + cached + pinned + in_use == total``.

    ``free``: unused, no key. ``cached``: unused but keyed (evictable prefix cache).
    ``pinned``: held by a pin (e.g. prefill KV awaiting the decode side's ack).
    ``in_use``: referenced by running requests only.
    """

    total: int
    free: int
    cached: int
    pinned: int
    in_use: int

    @property
    def num_allocatable(self) -> int:
        """Blocks a new allocation may take now (free, then evicting cached)."""
        return self.free + self.cached


class BlockManager:
    """Block tables of the requests on one worker (one KV cache, one ``block_size``).

    Ownership, per ``request_id``:

    * After ``allocate`` the request holds one reference on every block of its table
      (``block_ids``): the prefix-cache hits it was given and the blocks allocated for
      it. Shared prefix blocks have one reference per request holding them.
    * ``free`` gives all of them back. A block whose count reaches 0 stays in the
      prefix cache (if keyed) until evicted by a later allocation.
    * ``pin`` moves the table from the request to a pin under the same id: the request
      no longer exists (``has_request`` is False, ``free`` returns False), the pin holds
      the blocks, and nothing can evict them. ``unpin`` releases them, exactly once.
    * ``get_cached_prefix`` takes nothing; its result is valid until the next call that
      allocates, and must be passed to ``allocate`` before then.

    An id is either a request or a pin, never both. Errors in the caller's use (unknown
    ids for ``pin``, cached blocks on a second ``allocate``) raise ``ValueError`` or
    ``KeyError`` before anything changes.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks)
        # request id -> its blocks, in order: a tuple, replaced when it grows (every block
        # size tokens), so the scheduler reads it each step without a copy
        self._tables: dict[str, tuple[int, ...]] = {}
        self._pins: dict[str, list[int]] = {}  # pin id -> pinned blocks, in order
        # request id -> how many leading blocks cache_full_blocks has already seen
        self._num_hashed_blocks: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached."""
        return self._pool.num_free

    def num_blocks_needed(self, num_tokens: int) -> int:
        """``ceil(num_tokens / block_size)``."""
        return num_blocks_for(num_tokens, self.block_size)

    def get_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest leading run of ``block_hashes`` in the prefix cache
        (``[]`` when prefix caching is disabled). Takes no reference."""
        if not self.enable_prefix_caching:
            return []
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (``KeyError`` if unknown)."""
        return list(self._tables[request_id])

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's block table, as a tuple (``KeyError`` if unknown)."""
        return self._tables[request_id]

    def pinned_block_ids(self, request_id: str) -> list[int]:
        """A copy of the blocks pinned under ``request_id`` (``KeyError`` if none)."""
        return list(self._pins[request_id])

    def num_keyed_blocks(self, request_id: str) -> int:
        """How many of the request's leading blocks ``cache_full_blocks`` has keyed (0 for
        an unknown id)."""
        return self._num_hashed_blocks.get(request_id, 0)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pins

    def usage(self) -> KVCacheUsage:
        pool = self._pool
        return KVCacheUsage(
            total=pool.num_blocks,
            free=pool.num_free_uncached,
            cached=pool.num_cached,
            pinned=pool.num_pinned,
            in_use=pool.num_in_use,
        )

    # ---------------------------------------------------------------- lifecycle
    def allocate(
        self, request_id: str, num_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Make the request hold ``num_blocks_needed(num_tokens)`` blocks.

        On the request's first call, ``cached_block_ids`` (from ``get_cached_prefix``)
        become its leading blocks, one reference taken on each; later calls only grow
        the table (a smaller ``num_tokens`` is a no-op). Returns the newly allocated
        block ids (not the cached ones), or ``None`` when too few blocks are free; then
        nothing changed, and a new request is not registered.
        """
        table = self._tables.get(request_id)
        if (table is not None and not cached_block_ids and num_tokens >= 0
                and num_tokens <= len(table) * self.block_size):
            return []  # the usual decode step: its blocks already hold it (never pinned)
        self._check_allocate_args(request_id, table, num_tokens, cached_block_ids)
        num_held = len(table) if table is not None else len(cached_block_ids)
        num_new = max(0, self.num_blocks_needed(num_tokens) - num_held)
        # Idle cached hits leave the free queue when touched: not allocatable for us.
        num_hits_idle = sum(self._pool.is_free_queued(b) for b in cached_block_ids)
        if num_new > self._pool.num_free - num_hits_idle:
            return None
        self._pool.touch(cached_block_ids)
        new_block_ids = self._pool.allocate(num_new)
        assert new_block_ids is not None  # guaranteed by the check above
        if table is None:
            table = tuple(cached_block_ids)
            self._num_hashed_blocks[request_id] = 0
        self._tables[request_id] = (*table, *new_block_ids)
        return new_block_ids

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Key the request's leading full, computed blocks: ``block_hashes[i]`` is the
        key of its ``i``-th block. Blocks already seen by an earlier call are skipped;
        a key already naming another block keeps naming that block (this block then
        stays unkeyed and is freed normally). No-op when prefix caching is disabled.
        ``KeyError`` if the request is unknown, ``ValueError`` if it holds fewer
        blocks than ``block_hashes`` names."""
        table = self._tables[request_id]
        if len(block_hashes) > len(table):
            raise ValueError(
                f"{len(block_hashes)} block hashes for request {request_id!r} holding "
                f"{len(table)} blocks"
            )
        if not self.enable_prefix_caching:
            return
        start = self._num_hashed_blocks[request_id]
        for index in range(start, len(block_hashes)):
            self._pool.register_hash(table[index], block_hashes[index])
        self._num_hashed_blocks[request_id] = max(start, len(block_hashes))

    def free(self, request_id: str) -> bool:
        """Give back the request's references; blocks left unreferenced join the LRU
        tail last-block-first, so a sequence's tail is evicted before its prefix.
        Returns False (changing nothing) for an unknown id; never raises."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return False
        del self._num_hashed_blocks[request_id]
        self._pool.release(reversed(table))
        return True

    def pin(self, request_id: str) -> None:
        """Move the request's blocks to a pin held under ``request_id`` (the blocks
        never become evictable in between). ``KeyError`` if the request is unknown."""
        table = self._tables[request_id]
        self._pool.pin(table)
        self._pool.release(table)
        del self._tables[request_id]
        del self._num_hashed_blocks[request_id]
        self._pins[request_id] = list(table)

    def unpin(self, request_id: str) -> bool:
        """Release the pin under ``request_id`` (last block first, as ``free``).
        Returns False for an unknown or already released pin; never raises."""
        block_ids = self._pins.pop(request_id, None)
        if block_ids is None:
            return False
        self._pool.unpin(reversed(block_ids))
        return True

    def publish_events(self, events: KVEventLog) -> None:
        """Append every key the prefix cache gains or loses to ``events`` (first the
        keys it holds now): ``BlockPool.publish_events``."""
        self._pool.publish_events(events)

    def reset_prefix_cache(self) -> bool:
        """Forget the keys of all idle cached blocks; blocks held by requests or pins
        keep theirs. Returns True if the prefix cache is now empty."""
        self._pool.reset_prefix_cache()
        return self._pool.num_hashed == 0

    # ----------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Pool integrity, plus: every block's reference count equals the number of
        tables holding it and its pin count the number of pins holding it; no table
        repeats a block; no id is both a request and a pin. Raises
        ``KVCacheIntegrityError``."""
        self._pool.check_integrity()
        both = self._tables.keys() & self._pins.keys()
        _require(not both, f"ids both requests and pins: {sorted(both)}")
        _require(
            self._tables.keys() == self._num_hashed_blocks.keys(),
            "hashed-block counters out of step with the block tables",
        )
        for owner_id, block_ids in (*self._tables.items(), *self._pins.items()):
            _require(
                len(set(block_ids)) == len(block_ids),
                f"{owner_id!r} holds a block twice: {block_ids}",
            )
        refs, pins = [0] * self.num_blocks, [0] * self.num_blocks
        for counts, holders in ((refs, self._tables), (pins, self._pins)):
            for owner_id, block_ids in holders.items():
                for b in block_ids:
                    _require(0 <= b < self.num_blocks, f"{owner_id!r} holds block {b}, "
                             f"outside the pool of {self.num_blocks}")
                    counts[b] += 1
        ref_counts, pin_counts = self._pool.counts_by_block()
        if refs == ref_counts and pins == pin_counts:
            return
        block_id = next(b for b in range(self.num_blocks)
                        if refs[b] != ref_counts[b] or pins[b] != pin_counts[b])
        raise KVCacheIntegrityError(
            f"block {block_id}: ref {ref_counts[block_id]} / pin {pin_counts[block_id]}, but "
            f"held by {refs[block_id]} requests / {pins[block_id]} pins")

    # ----------------------------------------------------------------- internals
    def _check_allocate_args(
        self,
        request_id: str,
        table: tuple[int, ...] | None,
        num_tokens: int,
        cached_block_ids: Sequence[int],
    ) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if request_id in self._pins:
            raise ValueError(f"request {request_id!r} is pinned; unpin it first")
        if not cached_block_ids:
            return
        if table is not None:
            raise ValueError(f"cached blocks given on a later allocate of {request_id!r}")
        if len(cached_block_ids) > self.num_blocks_needed(num_tokens):
            raise ValueError(
                f"{len(cached_block_ids)} cached blocks exceed the "
                f"{self.num_blocks_needed(num_tokens)} needed for {num_tokens} tokens"
            )
        if len(set(cached_block_ids)) != len(cached_block_ids):
            raise ValueError(f"cached blocks repeat an id: {list(cached_block_ids)}")
        for block_id in cached_block_ids:
            if not 0 <= block_id < self.num_blocks or self._pool.block_hash(block_id) is None:
                raise ValueError(f"block {block_id} is not in the prefix cache")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KVCacheIntegrityError(message)
