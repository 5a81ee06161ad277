"""Block-level bookkeeping for the paged KV cache: reference counts, pins, prefix hashes.

Torch-free: blocks are integer ids ``0 .. num_blocks - 1``; the model runner alone turns
them into tensor slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

from engine.kvcache.block_hash import BlockHash
from engine.kvcache.events import KVEventLog


class KVCacheIntegrityError(AssertionError):
    """The pool's (or a manager's) bookkeeping contradicts itself: a bug, never user error."""


class BlockPool:
    """Reference counts, pin counts and prefix-cache hashes of ``num_blocks`` KV blocks.

    Every block is in exactly one category:

    ============  ===========  ===========  ==========  ================================
    category      ref count    pin count    hash        in the free queue
    ============  ===========  ===========  ==========  ================================
    free          0            0            none        yes
    cached        0            0            set         yes (evictable)
    pinned        any          > 0          any         no
    in use        > 0          0            any         no
    ============  ===========  ===========  ==========  ================================

    The free queue is one LRU (head = evicted first) of exactly the blocks with
    ``ref == pin == 0``, cached or not. ``allocate`` pops from the head, dropping the
    hash of a cached block it takes (eviction). A block whose last reference or pin
    goes away joins the tail. A block keeps its hash while held, so a prefix-cache hit
    can ``touch`` it whether it is idle or shared with a running request.

    Ownership: every reference is owned by whoever took it (``allocate`` or ``touch``)
    and must be given back with exactly one ``release``; likewise ``pin``/``unpin``.
    The pool does not know the owners; ``BlockManager`` does.

    Events: once ``publish_events`` attached a ``KVEventLog``, every key the pool gains
    or loses is appended to it (``engine.kvcache.events``).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._pin_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        # LRU of blocks with ref == pin == 0; head (first) is evicted first.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Tracked incrementally; check_integrity recounts them from scratch.
        self._num_cached = 0  # in the free queue and hashed
        self._num_pinned = 0  # pin count > 0
        self._events: KVEventLog | None = None

    # ------------------------------------------------------------------ counters
    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now: free plus evictable cached."""
        return len(self._free_queue)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free_queue) - self._num_pinned

    @property
    def num_free_uncached(self) -> int:
        return len(self._free_queue) - self._num_cached

    @property
    def num_hashed(self) -> int:
        """Blocks carrying a key, idle or held: the size of the prefix cache."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def pin_count(self, block_id: int) -> int:
        return self._pin_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def is_free_queued(self, block_id: int) -> bool:
        """True if ``block_id`` has ``ref == pin == 0`` (allocatable, maybe cached)."""
        return block_id in self._free_queue

    def publish_events(self, events: KVEventLog) -> None:
        """From now on, append every key gained or lost to ``events``; it first gets
        the keys the pool holds already."""
        events.stored_all(self._hash_to_block)
        self._events = events

    # --------------------------------------------------------------- operations
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks from the LRU head, each with one reference (the
        caller's). Cached blocks taken are evicted (hash dropped). All-or-nothing:
        returns ``None`` and changes nothing if fewer than ``num_blocks`` are free."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free_queue):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            if self._block_hashes[block_id] is not None:
                self._num_cached -= 1
                self._evict_hash(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a shared block). A
        block in the free queue leaves it; its hash, if any, is kept."""
        block_ids = self._checked(block_ids)
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0 and self._pin_counts[block_id] == 0:
                self._leave_free_queue(block_id)
            self._ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Give back one reference on each block, in order. Blocks left with no
        reference and no pin join the LRU tail in that order (first given, first
        evicted). Raises ``ValueError`` (changing nothing) for a block without a
        reference to give back."""
        block_ids = self._checked(block_ids)
        for block_id, count in Counter(block_ids).items():
            if self._ref_counts[block_id] < count:
                raise ValueError(f"release of block {block_id}, which has no reference left")
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0 and self._pin_counts[block_id] == 0:
                self._enter_free_queue(block_id)

    def pin(self, block_ids: Iterable[int]) -> None:
        """Pin each block once: it cannot be evicted or reallocated until unpinned."""
        block_ids = self._checked(block_ids)
        for block_id in block_ids:
            if self._pin_counts[block_id] == 0:
                if self._ref_counts[block_id] == 0:
                    self._leave_free_queue(block_id)
                self._num_pinned += 1
            self._pin_counts[block_id] += 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Drop one pin from each block, in order; like ``release`` for the free queue.
        Raises ``ValueError`` (changing nothing) for a block without a pin."""
        block_ids = self._checked(block_ids)
        for block_id, count in Counter(block_ids).items():
            if self._pin_counts[block_id] < count:
                raise ValueError(f"unpin of block {block_id}, which has no pin left")
        for block_id in block_ids:
            self._pin_counts[block_id] -= 1
            if self._pin_counts[block_id] == 0:
                self._num_pinned -= 1
                if self._ref_counts[block_id] == 0:
                    self._enter_free_queue(block_id)

    def register_hash(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that held block ``block_id`` (full and computed) has key ``block_hash``.

        Returns True if the block now carries that key. Returns False, changing
        nothing, when the key already names another block (same content computed
        twice: the first copy stays the cached one). Raises ``ValueError`` if the block
        is not held (no reference, no pin) or already carries a different key.
        """
        (block_id,) = self._checked([block_id])
        if self._ref_counts[block_id] == 0 and self._pin_counts[block_id] == 0:
            raise ValueError(f"cannot register a hash on unheld block {block_id}")
        current = self._block_hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already has a different hash")
            return True
        if block_hash in self._hash_to_block:
            return False
        self._block_hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        if self._events is not None:
            self._events.stored(block_hash)
        return True

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash``, or None. Takes no reference."""
        return self._hash_to_block.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Drop the hash of every idle cached block (held blocks keep theirs); the
        blocks stay in the free queue in the same order. Returns how many were dropped."""
        dropped = 0
        for block_id in self._free_queue:
            if self._block_hashes[block_id] is not None:
                self._evict_hash(block_id)
                dropped += 1
        self._num_cached -= dropped
        return dropped

    # ----------------------------------------------------------------- internals
    def _checked(self, block_ids: Iterable[int]) -> list[int]:
        block_ids = list(block_ids)
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
        return block_ids

    def _enter_free_queue(self, block_id: int) -> None:
        self._free_queue[block_id] = None
        if self._block_hashes[block_id] is not None:
            self._num_cached += 1

    def _leave_free_queue(self, block_id: int) -> None:
        del self._free_queue[block_id]
        if self._block_hashes[block_id] is not None:
            self._num_cached -= 1

    def _evict_hash(self, block_id: int) -> None:
        """Forget the block's key (not the ``_num_cached`` counter: callers adjust it)."""
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hashes[block_id] = None
            if self._events is not None:
                self._events.removed(block_hash)

    # ----------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Recount every category from the per-block state and compare with the tracked
        counters, the free queue and the hash map. Raises ``KVCacheIntegrityError``."""
        refs, pins, hashes = self._ref_counts, self._pin_counts, self._block_hashes
        if min(refs, default=0) < 0 or min(pins, default=0) < 0:
            for block_id, (ref, pin) in enumerate(zip(refs, pins, strict=True)):
                _category(block_id, ref, pin, None)  # raises at the first, naming it
        idle = {b for b, (ref, pin) in enumerate(zip(refs, pins, strict=True))
                if ref == 0 and pin == 0}
        hashed = {b: h for b, h in enumerate(hashes) if h is not None}
        pinned, cached = self.num_blocks - pins.count(0), sum(1 for b in idle if b in hashed)
        _require(
            set(self._free_queue) == idle,
            f"free queue {sorted(self._free_queue)} != blocks with ref == pin == 0 {sorted(idle)}",
        )
        _require(cached == self._num_cached and pinned == self._num_pinned,
                 f"tracked cached={self._num_cached} pinned={self._num_pinned}, recounted "
                 f"cached={cached} pinned={pinned}")
        _require(
            {h: b for b, h in hashed.items()} == self._hash_to_block
            and len(self._hash_to_block) == len(hashed),
            f"hash map ({len(self._hash_to_block)} entries) disagrees with per-block "
            f"hashes ({len(hashed)} hashed blocks)",
        )

    def counts_by_block(self) -> tuple[list[int], list[int]]:
        """Copies of every block's reference and pin counts."""
        return list(self._ref_counts), list(self._pin_counts)


def _category(block_id: int, ref_count: int, pin_count: int,
              block_hash: BlockHash | None) -> str:
    _require(
        ref_count >= 0 and pin_count >= 0,
        f"block {block_id} has ref {ref_count}, pin {pin_count}",
    )
    if pin_count > 0:
        return "pinned"
    if ref_count > 0:
        return "in_use"
    return "free" if block_hash is None else "cached"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KVCacheIntegrityError(message)


__all__ = ["BlockPool", "KVCacheIntegrityError"]
