"""Random lifecycles against the block manager, checked against a small model.

The model knows which request or pin holds which block and what content each block
was computed with; it predicts every allocation's success, the in-use and pinned
counts, and that a prefix hit never returns a block whose content was overwritten.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.kvcache import BlockHash, BlockManager, compute_block_hashes

NUM_BLOCKS = 6
BLOCK_SIZE = 2
REQUEST_IDS = [f"r{i}" for i in range(4)]
# Shared prefixes make prefix hits common; decoding 7s after PROMPTS[2] recomputes
# blocks of PROMPTS[1] (duplicate content).
PROMPTS = [
    [1, 2, 3, 4, 5, 6],
    [1, 2, 3, 4, 7, 7, 7],
    [1, 2, 3, 4],
    [5, 5, 5, 5, 5, 5, 5, 5],
    [9],
]
prompts = st.sampled_from(PROMPTS)
decode_tokens = st.lists(st.sampled_from([7, 8]), max_size=3)


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(enable_prefix_caching=st.booleans())
    def setup(self, enable_prefix_caching: bool) -> None:
        self.manager = BlockManager(
            NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching
        )
        self.tokens: dict[str, list[int]] = {}  # request id -> its sequence so far
        self.tables: dict[str, list[int]] = {}
        self.pins: dict[str, list[int]] = {}
        self.content: dict[int, BlockHash] = {}  # block id -> key it was computed with

    # ----------------------------------------------------------------- model
    def _held(self) -> set[int]:
        return {b for t in (*self.tables.values(), *self.pins.values()) for b in t}

    def _allocatable(self, hits: list[int]) -> int:
        held = self._held()
        idle_hits = sum(b not in held for b in hits)
        return NUM_BLOCKS - len(held) - idle_hits

    def _allocate(self, request_id: str, tokens: list[int], hits: list[int]) -> bool:
        """Allocate through the manager, predicting success; returns it."""
        num_held = len(self.tables.get(request_id, hits))
        num_new = max(0, self.manager.num_blocks_needed(len(tokens)) - num_held)
        expect_ok = num_new <= self._allocatable(hits)
        new_block_ids = self.manager.allocate(request_id, len(tokens), hits)
        assert (new_block_ids is not None) == expect_ok
        if new_block_ids is None:
            return False
        assert len(new_block_ids) == num_new
        assert not set(new_block_ids) & self._held()
        for block_id in new_block_ids:
            self.content.pop(block_id, None)  # about to be overwritten
        self.tables.setdefault(request_id, list(hits)).extend(new_block_ids)
        self.tokens[request_id] = tokens
        return True

    # --------------------------------------------------------------- helpers
    def _running(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tables)), label="request_id")

    def _check_hits(self, block_hashes: list[BlockHash]) -> list[int]:
        hits = self.manager.get_cached_prefix(block_hashes)
        for block_id, block_hash in zip(hits, block_hashes):
            assert self.content.get(block_id) == block_hash
        return hits

    def _cache(self, request_id: str) -> None:
        block_hashes = compute_block_hashes(self.tokens[request_id], BLOCK_SIZE)
        self.manager.cache_full_blocks(request_id, block_hashes)
        for block_id, block_hash in zip(self.tables[request_id], block_hashes):
            self.content[block_id] = block_hash

    # ----------------------------------------------------------------- rules
    @precondition(lambda self: len(self.tables) + len(self.pins) < len(REQUEST_IDS))
    @rule(data=st.data(), prompt=prompts)
    def prefill(self, data: st.DataObject, prompt: list[int]) -> None:
        """Allocate with the cached prefix, 'compute' the prompt, key its full blocks."""
        unused = [r for r in REQUEST_IDS if r not in self.tables and r not in self.pins]
        request_id = data.draw(st.sampled_from(unused), label="request_id")
        hits = self._check_hits(compute_block_hashes(prompt, BLOCK_SIZE))
        if self._allocate(request_id, prompt, hits):
            self._cache(request_id)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), new_tokens=decode_tokens)
    def grow(self, data: st.DataObject, new_tokens: list[int]) -> None:
        request_id = self._running(data)
        self._allocate(request_id, self.tokens[request_id] + new_tokens, [])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        self._cache(self._running(data))

    @precondition(lambda self: self.tables or self.pins)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        # Mostly running requests; also pinned and unknown ids, which free refuses.
        candidates = [*sorted(self.tables), *sorted(self.pins), "never-started"]
        request_id = data.draw(st.sampled_from(candidates), label="request_id")
        assert self.manager.free(request_id) == (request_id in self.tables)
        self.tables.pop(request_id, None)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        request_id = self._running(data)
        self.manager.pin(request_id)
        self.pins[request_id] = self.tables.pop(request_id)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        # Mostly pins; also running and unknown ids, which unpin refuses.
        candidates = [*sorted(self.pins), *sorted(self.tables), "never-started"]
        request_id = data.draw(st.sampled_from(candidates), label="request_id")
        assert self.manager.unpin(request_id) == (request_id in self.pins)
        self.pins.pop(request_id, None)

    @rule(prompt=prompts, new_tokens=decode_tokens)
    def lookup(self, prompt: list[int], new_tokens: list[int]) -> None:
        self._check_hits(compute_block_hashes(prompt + new_tokens, BLOCK_SIZE))

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        self.manager.check_integrity()
        usage = self.manager.usage()
        pinned = {b for t in self.pins.values() for b in t}
        in_use = {b for t in self.tables.values() for b in t} - pinned
        assert (usage.pinned, usage.in_use) == (len(pinned), len(in_use))
        assert usage.free + usage.cached == NUM_BLOCKS - len(pinned) - len(in_use)
        assert self.manager.num_free_blocks == usage.num_allocatable
        for request_id, table in self.tables.items():
            assert self.manager.block_ids(request_id) == table
            assert len(table) == self.manager.num_blocks_needed(len(self.tokens[request_id]))

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for request_id in list(self.tables):
            assert self.manager.free(request_id)
        for request_id in list(self.pins):
            assert self.manager.unpin(request_id)
        self.manager.check_integrity()
        usage = self.manager.usage()
        assert usage.in_use == usage.pinned == 0
        assert usage.free + usage.cached == usage.total == NUM_BLOCKS
        assert self.manager.reset_prefix_cache()
        assert self.manager.usage().free == NUM_BLOCKS
        self.manager.check_integrity()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
